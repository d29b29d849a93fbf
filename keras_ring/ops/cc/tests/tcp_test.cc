// The TCP mesh over loopback with ranks as threads: it forms and carries data, and a peer
// greeting with another build is refused with an error naming it, in bounded time, instead
// of being trusted to share this build's slot layout and protocol.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../core/tcp_transport.h"
#include "test_harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using namespace keras_ring;  // NOLINT: test-local

// Builds a 2-rank mesh where rank r claims builds[r]; returns each rank's Create status and,
// for ranks whose mesh formed, the result of one exchange of a byte with the other rank.
struct MeshResult {
  Status create[2];
  Status exchange[2];
};

MeshResult TwoRankMesh(const std::string builds[2]) {
  MeshResult result;
  int ports[2];
  const int listen_fds[2] = {ListenOnLoopback(&ports[0]), ListenOnLoopback(&ports[1])};
  const std::vector<PeerAddress> peers = {{"127.0.0.1", ports[0]}, {"127.0.0.1", ports[1]}};
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<TcpTransport> t;
      result.create[r] = TcpTransport::Create(r, 2, listen_fds[r], peers, /*job_token=*/42,
                                              Deadline::After(60.0), &t, builds[r]);
      if (!result.create[r].ok()) return;  // t is destroyed: its sockets close
      char out = static_cast<char>('a' + r), in = 0;
      result.exchange[r] = t->SendRecv(1 - r, &out, 1, 1 - r, &in, 1, Deadline::After(60.0));
      if (result.exchange[r].ok() && in != 'a' + (1 - r)) {
        result.exchange[r] = Status(Code::kInternal, "received the wrong byte");
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int fd : listen_fds) close(fd);
  return result;
}

}  // namespace

TEST(Tcp_SameBuildFormsTheMeshAndCarriesData) {
  const std::string builds[2] = {"keras_ring 1 tf 2.21", "keras_ring 1 tf 2.21"};
  MeshResult m = TwoRankMesh(builds);
  for (int r = 0; r < 2; ++r) {
    CHECK_OK(m.create[r]) << "rank " << r;
    CHECK_OK(m.exchange[r]) << "rank " << r;
  }
}

TEST(Tcp_PeerOfAnotherBuildIsRefusedByName) {
  const std::string builds[2] = {"keras_ring 1 tf 2.21", "keras_ring 2 tf 2.22"};
  const auto start = Clock::now();
  MeshResult m = TwoRankMesh(builds);
  // Rank 0 accepts rank 1's greeting and refuses it, naming the rank and its own build.
  CHECK(m.create[0].code() == Code::kFailedPrecondition) << m.create[0].message();
  CHECK(m.create[0].peer() == 1) << m.create[0].peer();
  CHECK(m.create[0].message().find("rank 1 runs a different keras_ring build") !=
        std::string::npos)
      << m.create[0].message();
  CHECK(m.create[0].message().find("keras_ring 1 tf 2.21") != std::string::npos)
      << m.create[0].message();
  // Rank 1 only connects; it must learn of the refusal at its first exchange, not hang.
  CHECK(!m.create[1].ok() || !m.exchange[1].ok()) << "rank 1 went on as if nothing happened";
  // The refusal, not the 60 s connect deadline, ends it; bounded, not a speed bound.
  CHECK(SecondsSince(start) < 30.0) << SecondsSince(start) << " s";
}

}  // namespace kr_test

namespace kr_test {
namespace {

// A loopback port where nothing listens (bound for a moment, then closed): connects there
// are refused.
int ClosedPort() {
  int port = 0;
  close(ListenOnLoopback(&port));
  return port;
}

// Rank 1 connects to rank 0 at `rank0_hosts` (comma-separated candidates, each at `port`, or
// at rank 0's real port where `port` is 0; then rank 0 runs too). Returns rank 1's status.
Status ConnectThroughCandidates(const std::string& rank0_hosts, int port, double deadline_s) {
  int ports[2];
  const int listen_fds[2] = {ListenOnLoopback(&ports[0]), ListenOnLoopback(&ports[1])};
  const std::vector<PeerAddress> peers = {{rank0_hosts, port ? port : ports[0]},
                                          {"127.0.0.1", ports[1]}};
  Status create[2];
  std::vector<std::thread> threads;
  for (int r = port ? 1 : 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<TcpTransport> t;
      create[r] = TcpTransport::Create(r, 2, listen_fds[r], peers, 7, Deadline::After(deadline_s),
                                       &t);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int fd : listen_fds) close(fd);
  return create[1];
}

}  // namespace

TEST(Tcp_CandidateAddressesAreTriedInOrder) {
  // The first candidate does not resolve, the second is the real one.
  CHECK_OK(ConnectThroughCandidates("no-such-host.invalid,127.0.0.1", 0, 10.0));
}

TEST(Tcp_AnAddressWhereNothingListensFailsFastNamingIt) {
  const int port = ClosedPort();
  const auto start = Clock::now();
  const Status s = ConnectThroughCandidates("127.0.0.1", port, 60.0);
  // Refusals end the wait long before the 60 s deadline.
  CHECK(s.code() == Code::kUnavailable) << static_cast<int>(s.code()) << " " << s.message();
  CHECK_EQ(s.peer(), 0);
  CHECK_CONTAINS(s.message(), "127.0.0.1:" + std::to_string(port) + " (Connection refused)");
  CHECK_CONTAINS(s.message(), "KERAS_RING_SOCKET_IFNAME");
  CHECK(SecondsSince(start) < 30.0) << SecondsSince(start) << " s";
}

}  // namespace kr_test

namespace kr_test {
namespace {

// A listener on 127.0.0.2 whose accept queue is full, so it drops every SYN, as a firewalled
// interface does. `port` 0 picks one.
class SilentListener {
 public:
  explicit SilentListener(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(0x7f000002);  // 127.0.0.2
    addr.sin_port = htons(static_cast<uint16_t>(port));
    CHECK(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) << errno;
    CHECK(listen(fd_, 0) == 0);
    socklen_t len = sizeof addr;
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    for (int i = 0; i < 2; ++i) {  // never accepted: they fill the queue
      fillers_.push_back(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      connect(fillers_.back(), reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    }
  }
  ~SilentListener() {
    for (int fd : fillers_) close(fd);
    close(fd_);
  }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::vector<int> fillers_;
};

}  // namespace

TEST(Tcp_ASilentAddressCostsAMomentNotAConnectTimeout) {
  // Rank 0 offers 127.0.0.2 first, where SYNs are dropped, then 127.0.0.1 where it listens.
  // Tried in turn with a 3 s attempt each, the data and control connections could not form
  // within the deadline.
  int ports[2];
  const int listen_fds[2] = {ListenOnLoopback(&ports[0]), ListenOnLoopback(&ports[1])};
  const SilentListener silent(ports[0]);
  const std::vector<PeerAddress> peers = {{"127.0.0.2,127.0.0.1", ports[0]},
                                          {"127.0.0.1", ports[1]}};
  Status create[2];
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<TcpTransport> t;
      create[r] = TcpTransport::Create(r, 2, listen_fds[r], peers, 9, Deadline::After(2.5), &t);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int fd : listen_fds) close(fd);
  CHECK_OK(create[0]);
  CHECK_OK(create[1]);
}

}  // namespace kr_test

namespace kr_test {
namespace {

// Three ranks of one host form a job (TCP mesh, then shared memory), but the table gives
// rank 1's address as `rank1`. Returns each rank's status.
std::vector<Status> JobWithRank1At(const PeerAddress& rank1, double timeout_seconds) {
  std::vector<std::unique_ptr<Transport>> world;
  return TryConnectHostWorld({0, 0, 0}, 11, timeout_seconds, &world, 1, rank1);
}

void CheckEveryRankNamesRank1(const std::vector<Status>& result, const std::string& where) {
  for (int r = 0; r < static_cast<int>(result.size()); ++r) {
    const Status& s = result[static_cast<size_t>(r)];
    CHECK(!s.ok()) << "rank " << r << " formed a job with a rank it cannot reach";
    CHECK_CONTAINS(s.message(), "could not connect to rank 1 at any address it offered "
                                "(rank 2 tried): " + where);
    CHECK_EQ(s.peer(), 1) << "rank " << r << ": " << s.message();
  }
  // Rank 1 heard it through rank 0: nobody could reach it directly.
  CHECK_CONTAINS(result[1].message(), "reported by rank 0");
}

}  // namespace

TEST(Tcp_ARankNobodyCanReachHearsWhyInsteadOfTimingOut) {
  // Rank 1 offers an address where nothing listens. Rank 2 cannot connect to it; rank 1
  // waits for rank 2 to connect and cannot be told directly. Rank 2 tells rank 0, which
  // passes it on: every rank names the address, long before the deadline.
  const int closed = ClosedPort();
  const auto start = Clock::now();
  const std::vector<Status> result = JobWithRank1At({"127.0.0.1", closed}, 60);
  CheckEveryRankNamesRank1(result, "127.0.0.1:" + std::to_string(closed) +
                                       " (Connection refused)");
  CHECK(SecondsSince(start) < 30.0) << SecondsSince(start) << " s";  // a bound, not a speed
}

TEST(Tcp_ARankBehindAFirewallHearsWhyBeforeItsOwnWaitEnds) {
  // Rank 1 offers 127.0.0.2, where a listener with a full accept queue drops every SYN (as a
  // firewall does): rank 2 tries until its deadline. Connecting gives up before accepting
  // does, so rank 1, waiting for rank 2, hears the cause rather than its own timeout.
  const SilentListener silent(0);
  const std::vector<Status> result = JobWithRank1At({"127.0.0.2", silent.port()}, 10);
  CheckEveryRankNamesRank1(result, "127.0.0.2:" + std::to_string(silent.port()) + " (");
  CHECK(result[1].message().find("timed out waiting for rank 2") == std::string::npos)
      << result[1].message();
}

namespace {

// Rank 0 sends `pieces` pieces of 1 KiB, `gap_ms` apart, each Send with a deadline of
// `timeout_s`; rank 1 receives them all in one Recv with that deadline. Returns rank 1's
// status (and checks the bytes where it succeeded).
Status TrickleToRank1(int pieces, int gap_ms, double timeout_s) {
  int ports[2];
  const int listen_fds[2] = {ListenOnLoopback(&ports[0]), ListenOnLoopback(&ports[1])};
  const std::vector<PeerAddress> peers = {{"127.0.0.1", ports[0]}, {"127.0.0.1", ports[1]}};
  const size_t piece = 1024, total = piece * static_cast<size_t>(pieces);
  Status received;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<TcpTransport> t;
      Status s = TcpTransport::Create(r, 2, listen_fds[r], peers, 5, Deadline::After(60.0), &t);
      if (!s.ok()) {
        if (r == 1) received = s;
        return;
      }
      std::vector<char> data(total);
      if (r == 0) {
        for (size_t i = 0; i < total; ++i) data[i] = static_cast<char>(i * 7);
        for (int k = 0; k < pieces; ++k) {
          if (!t->Send(1, data.data() + piece * static_cast<size_t>(k), piece,
                       Deadline::After(timeout_s)).ok()) return;
          std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms));  // the slow link
        }
        char done = 0;  // stays until rank 1 has its verdict
        (void)t->Recv(1, &done, 1, Deadline::After(60.0));
        return;
      }
      received = t->Recv(0, data.data(), total, Deadline::After(timeout_s));
      for (size_t i = 0; received.ok() && i < total; ++i) {
        if (data[i] != static_cast<char>(i * 7)) received = Status(Code::kInternal, "bad byte");
      }
      char done = 1;
      (void)t->Send(0, &done, 1, Deadline::After(60.0));
    });
  }
  for (std::thread& t : threads) t.join();
  for (int fd : listen_fds) close(fd);
  return received;
}

}  // namespace

TEST(Tcp_TheTimeoutBoundsASilenceNotASlowTransfer) {
  // 15 pieces 0.2 s apart take 3 s, past the 2 s each wait is given: bytes that keep coming
  // (a slow link carrying a large step) renew the deadline.
  CHECK_OK(TrickleToRank1(15, 200, 2.0));
}

TEST(Tcp_ASilentPeerTimesOutNamingWhereItIs) {
  // One piece, then 4 s of silence against a 1 s deadline.
  const Status s = TrickleToRank1(2, 4000, 1.0);
  CHECK_EQ(static_cast<int>(s.code()), static_cast<int>(Code::kDeadlineExceeded)) << s.message();
  CHECK_CONTAINS(s.message(), "timed out waiting for rank 0 (at 127.0.0.1:");
  CHECK_CONTAINS(s.message(), ") to send data: nothing moved for 1 s");
  CHECK_EQ(s.peer(), 0);
}

}  // namespace kr_test
