#include "tcp_transport.h"

#include "tcp_connect.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace keras_ring {
namespace {

constexpr uint64_t kHelloMagic = 0x6b72696e67686921ull;  // "kringhi!"
constexpr int kPollSliceMs = 200;  // wake up this often to notice Abort()
// How long a rank that failed to form the mesh tries to reach its other lower ranks, only
// to tell them why.
constexpr double kRelaySeconds = 2.0;
constexpr std::chrono::microseconds kYieldBudget{200};  // as ShmOptions::yield_seconds

#ifndef KERAS_RING_BUILD_INFO
#define KERAS_RING_BUILD_INFO "unknown"
#endif

// Ranks must run the same build: slot layouts and protocols differ between builds, and a
// rank that rebuilt the library while another kept the old one would misread its peers.
uint64_t BuildHash(const std::string& build) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : build) h = (h ^ c) * 1099511628211ull;
  return h;
}

struct Hello {
  uint64_t magic;
  uint64_t job_token;
  uint64_t build_hash;
  int32_t rank;
  int32_t size;
  int32_t channel;  // kData or kControl
  int32_t reserved;
};
constexpr int32_t kData = 0;
constexpr int32_t kControl = 1;

// Sent on the control socket by a rank that gives up, so peers learn why and whom to blame
// instead of only seeing its sockets close.
struct AbortNotice {
  uint64_t magic;
  int32_t code;
  int32_t culprit;
  char message[kCauseMessageBytes];
};
constexpr uint64_t kNoticeMagic = 0x6b72696e67656e64ull;  // "kringend"

bool SendAllBlocking(int fd, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = send(fd, p, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

void SetSocketOptions(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
}

std::string Errno(int err) { return std::strerror(err); }

// " (at 10.0.0.2:41234)": where a connected socket's peer is, for messages about it.
std::string PeerWhere(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  char host[NI_MAXHOST], port[NI_MAXSERV];
  if (fd < 0 || getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 ||
      getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof host, port,
                  sizeof port, NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "";
  }
  const bool v6 = addr.ss_family == AF_INET6;
  return std::string(" (at ") + (v6 ? "[" : "") + host + (v6 ? "]:" : ":") + port + ")";
}

}  // namespace

const char* BuildInfo() { return KERAS_RING_BUILD_INFO; }

TcpTransport::TcpTransport(int rank, int size, const std::string& build)
    : rank_(rank),
      size_(size),
      build_(build),
      build_hash_(BuildHash(build)),
      fds_(static_cast<size_t>(size), -1),
      control_fds_(static_cast<size_t>(size), -1) {}

Status TcpTransport::Create(int rank, int size, int listen_fd,
                            const std::vector<PeerAddress>& peers, uint64_t job_token,
                            Deadline deadline, std::unique_ptr<TcpTransport>* out,
                            const std::string& build) {
  if (static_cast<int>(peers.size()) != size) {
    return Status(Code::kInvalidArgument, "peer table has " + std::to_string(peers.size()) +
                                              " entries for " + std::to_string(size) + " ranks");
  }
  std::unique_ptr<TcpTransport> t(new TcpTransport(rank, size, build));
  const Status s = t->FormMesh(listen_fd, peers, job_token, deadline);
  if (!s.ok()) {
    // Ranks this one did reach learn why it gave up (a notice on each control socket); they
    // pass it on as they give up in turn, so a rank nobody could reach hears the cause
    // instead of waiting out its deadline.
    t->AbortWith(s);
    return s;
  }
  for (size_t i = 0; i < t->fds_.size(); ++i) {
    if (t->fds_[i] >= 0) SetSocketOptions(t->fds_[i]);
    if (t->control_fds_[i] >= 0) SetSocketOptions(t->control_fds_[i]);
  }
  *out = std::move(t);
  return Status::OK();
}

Status TcpTransport::FormMesh(int listen_fd, const std::vector<PeerAddress>& peers,
                              uint64_t job_token, Deadline deadline) {
  // Lower ranks first: every rank connects downward and accepts upward, so no cycle waits.
  // Each pair gets a data socket and a control socket (for abort notices). Connecting gives
  // up a little before accepting does: a rank waiting for a peer that cannot reach it (a
  // firewall dropping what is sent there) then hears why before its own wait ends.
  const Clock::duration left = std::max(deadline.time() - Clock::now(), Clock::duration::zero());
  const Deadline connect_deadline(deadline.time() -
                                  std::min<Clock::duration>(left / 10, std::chrono::seconds(5)));
  Status failed;
  int peer = 0;
  for (; peer < rank_ && failed.ok(); ++peer) {
    for (int32_t channel : {kData, kControl}) {
      failed = ConnectTo(peer, peers[static_cast<size_t>(peer)], job_token, channel,
                         connect_deadline);
      if (!failed.ok()) break;
    }
  }
  if (!failed.ok()) {
    // The remaining lower ranks get a control socket only, to carry the notice of why this
    // rank gives up, all within a short bound of their own (the deadline may be what ran out).
    const Deadline relay = Deadline::After(kRelaySeconds);
    for (; peer < rank_; ++peer) {
      (void)ConnectTo(peer, peers[static_cast<size_t>(peer)], job_token, kControl, relay);
    }
    return failed;
  }
  // Higher ranks connect in any order; each accept takes whichever comes.
  for (int n = 0; n < 2 * (size_ - rank_ - 1); ++n) {
    KR_RETURN_IF_ERROR(AcceptFrom(listen_fd, job_token, deadline));
  }
  return Status::OK();
}

TcpTransport::~TcpTransport() {
  for (int fd : fds_) {
    if (fd >= 0) close(fd);
  }
  for (int fd : control_fds_) {
    if (fd >= 0) close(fd);
  }
}

namespace {

std::vector<std::string> SplitCandidates(const std::string& hosts) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= hosts.size()) {
    const size_t comma = std::min(hosts.find(',', start), hosts.size());
    if (comma > start) out.push_back(hosts.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

}  // namespace

Status TcpTransport::ConnectTo(int peer, const PeerAddress& addr, uint64_t job_token,
                               int32_t channel, Deadline deadline) {
  const std::vector<std::string> candidates = SplitCandidates(addr.host);
  // The peer listens before addresses are exchanged, so a refusal is no start-up race: the
  // address reaches a machine (or network namespace) where this peer does not listen; nor is
  // an unreachable network or host: no route leads there. A few passes absorb a transient
  // one. A silent candidate delays the next by kStaggerMs only, and the one that answered a
  // peer's host is tried first for its next connection. Each pass gives a connection twice
  // as long as the last to complete, up to 24 s: a link whose round trip exceeds the first
  // attempt (a saturated VPN, a satellite hop) still connects. Not longer: a peer's failure
  // is polled between passes only.
  constexpr int kStaggerMs = 250;
  constexpr int kAttemptMs = 3000;
  constexpr int kDefinitivePasses = 5;
  std::vector<std::string> errors(candidates.size(), "not tried");
  const auto remembered = reached_.find(addr.host);
  std::vector<size_t> order;
  if (remembered != reached_.end()) order.push_back(remembered->second);
  for (size_t c = 0; c < candidates.size(); ++c) {
    if (order.empty() || order[0] != c) order.push_back(c);
  }
  for (int pass = 0;; ++pass) {
    std::vector<ConnectTarget> targets;
    bool definitive = true;  // every candidate resolved and refused or unreachable
    for (size_t c : order) {
      const std::string unresolved = Resolve(candidates[c], addr.port, c, &targets);
      if (!unresolved.empty()) errors[c] = unresolved;
      definitive = definitive && unresolved.empty();
    }
    const ConnectOutcome got =
        ConnectFirst(targets, kStaggerMs, kAttemptMs << std::min(pass, 3), deadline);
    if (got.fd >= 0) {
      const size_t c = targets[got.winner].candidate;
      reached_[addr.host] = c;
      (channel == kData ? fds_ : control_fds_)[static_cast<size_t>(peer)] = got.fd;
      Hello hello{kHelloMagic, job_token, build_hash_, rank_, size_, channel, 0};
      if (!SendAllBlocking(got.fd, &hello, sizeof hello)) return PeerGone(peer, "connecting", errno);
      return Status::OK();
    }
    definitive = definitive && !targets.empty();
    for (size_t t = 0; t < targets.size(); ++t) {
      const int err = got.errs[t];
      if (err != 0) errors[targets[t].candidate] = Errno(err);
      if (err != ECONNREFUSED && err != ENETUNREACH && err != EHOSTUNREACH) definitive = false;
    }
    if (deadline.expired() || (definitive && pass + 1 >= kDefinitivePasses)) break;
    // A rank already reached may have given up meanwhile, maybe for this very address.
    KR_RETURN_IF_ERROR(PollPeerFailure());
    std::this_thread::sleep_for(std::chrono::milliseconds(50 << std::min(pass, 4)));  // back-off
  }
  std::string tried;
  for (size_t c = 0; c < candidates.size(); ++c) {
    tried += (c ? "; " : "") + candidates[c] + ":" + std::to_string(addr.port) + " (" +
             errors[c] + ")";
  }
  return Status(Code::kUnavailable,
                "could not connect to rank " + std::to_string(peer) + " at any address it "
                    "offered (rank " + std::to_string(rank_) + " tried): " +
                    (tried.empty() ? "none" : tried) + ". A refused connection means "
                    "nothing of this job listens there: the address belongs to another "
                    "machine or network namespace (ranks with one KERAS_RING_HOST_ID are "
                    "reached over loopback); an unreachable one, that no route leads there; "
                    "a timed-out one, that the network drops what is sent there. Set "
                    "KERAS_RING_SOCKET_IFNAME to the interface that connects the hosts",
                peer);
}

Status TcpTransport::AcceptFrom(int listen_fd, uint64_t job_token, Deadline deadline) {
  while (true) {
    // A rank already connected may give up meanwhile: one that could not reach a rank that
    // this one waits for tells why (see Create).
    KR_RETURN_IF_ERROR(PollPeerFailure());
    pollfd p{listen_fd, POLLIN, 0};
    int rc = poll(&p, 1, deadline.remaining_ms(kPollSliceMs));
    if (rc < 0 && errno != EINTR) return Status(Code::kInternal, "poll: " + Errno(errno));
    if (rc <= 0) {
      if (deadline.expired()) {
        int missing = -1;
        for (int r = size_ - 1; r > rank_; --r) {
          if (fds_[static_cast<size_t>(r)] < 0) missing = r;
        }
        return Status(Code::kDeadlineExceeded,
                      "timed out waiting for rank " + std::to_string(missing) +
                          " to connect to this rank's listener (at the addresses this rank "
                          "offered; a rank that cannot reach them says so in its own error)",
                      missing);
      }
      continue;
    }
    int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Hello hello{};
    // Read the greeting with a short bound so a stray connection cannot stall the start.
    timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ssize_t got = recv(fd, &hello, sizeof hello, MSG_WAITALL);
    if (got == static_cast<ssize_t>(sizeof hello) && hello.magic == kHelloMagic &&
        hello.job_token == job_token && hello.build_hash != build_hash_) {
      close(fd);
      return Status(Code::kFailedPrecondition,
                    "rank " + std::to_string(hello.rank) +
                        " runs a different keras_ring build than this rank (" + build_ +
                        "); install and build the same version on every host, with the same "
                        "TensorFlow",
                    hello.rank);
    }
    std::vector<int>* slots = hello.channel == kControl ? &control_fds_ : &fds_;
    if (got != static_cast<ssize_t>(sizeof hello) || hello.magic != kHelloMagic ||
        hello.job_token != job_token || hello.size != size_ || hello.rank <= rank_ ||
        hello.rank >= size_ || (hello.channel != kData && hello.channel != kControl) ||
        (*slots)[static_cast<size_t>(hello.rank)] >= 0) {
      close(fd);  // not one of ours
      continue;
    }
    timeval zero{0, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &zero, sizeof zero);
    (*slots)[static_cast<size_t>(hello.rank)] = fd;
    return Status::OK();
  }
}

Status TcpTransport::PeerGone(int peer, const char* what, int err) const {
  // A peer that gave up said why on its control socket just before closing; one that died
  // said nothing (its control socket shows EOF at once).
  const int control = control_fds_[static_cast<size_t>(peer)];
  pollfd p{control, POLLIN, 0};
  if (control >= 0 && poll(&p, 1, 100) > 0) {
    AbortNotice notice{};
    if (recv(control, &notice, sizeof notice, MSG_WAITALL | MSG_DONTWAIT) ==
            static_cast<ssize_t>(sizeof notice) &&
        notice.magic == kNoticeMagic) {
      notice.message[sizeof notice.message - 1] = '\0';
      return PeerGaveUp(peer, static_cast<Code>(notice.code), notice.culprit, notice.message);
    }
  }
  std::string msg = "lost connection to rank " + std::to_string(peer) + " while " + what;
  if (err == 0) {
    msg += ": the peer closed it (its process exited, crashed or was killed)";
  } else {
    msg += ": " + Errno(err);
  }
  return Status(Code::kUnavailable, msg, peer);
}

Status TcpTransport::Send(int peer, const void* data, size_t bytes, Deadline deadline) {
  return SendRecv(peer, data, bytes, -1, nullptr, 0, deadline);
}

Status TcpTransport::Recv(int peer, void* data, size_t bytes, Deadline deadline) {
  return SendRecv(-1, nullptr, 0, peer, data, bytes, deadline);
}

Status TcpTransport::SendRecv(int to, const void* send_data, size_t send_bytes, int from,
                              void* recv_data, size_t recv_bytes, Deadline deadline) {
  return Pump(to, send_data, send_bytes, from, recv_data, recv_bytes, nullptr, deadline);
}

Status TcpTransport::SendRecvFramed(int peer, const void* send_data, size_t send_bytes,
                                    void* recv_data, size_t head, size_t capacity,
                                    const FrameLength& length, size_t* received,
                                    Deadline deadline) {
  const Frame frame{capacity, &length, received};
  return Pump(peer, send_data, send_bytes, peer, recv_data, head, &frame, deadline);
}

Status TcpTransport::Pump(int to, const void* send_data, size_t send_bytes, int from,
                          void* recv_data, size_t recv_bytes, const Frame* frame,
                          Deadline deadline) {
  const char* sp = static_cast<const char*>(send_data);
  char* rp = static_cast<char*>(recv_data);
  size_t sent = 0, received = 0;
  // The deadline bounds a silence, not the transfer: bytes moving renew it, so a slow link
  // carrying a large step (a segment at 1 Mbit/s) is no dead peer.
  const Clock::duration budget = std::max(deadline.time() - Clock::now(), Clock::duration{});
  // Before it blocks in poll(), a wait that may yield checks the sockets and yields the core
  // for up to kYieldBudget: on loopback a blocked poll() costs a wake-up per message (2 ranks,
  // 4 KiB in a graph: ~140 us against ~20 for MPICH over TCP).
  const bool yielding = deadline.may_yield() || yield_in_graphs_;
  Clock::time_point waiting_since{};
  while (sent < send_bytes || received < recv_bytes) {
    if (abort_.aborted()) return abort_.WaitError();
    KR_RETURN_IF_ERROR(InterruptStatus());
    pollfd fds[2];
    nfds_t n = 0;
    int send_idx = -1, recv_idx = -1;
    if (sent < send_bytes) {
      send_idx = static_cast<int>(n);
      fds[n++] = pollfd{fds_[static_cast<size_t>(to)], POLLOUT, 0};
    }
    if (received < recv_bytes) {
      if (send_idx >= 0 && from == to) {
        fds[send_idx].events |= POLLIN;
        recv_idx = send_idx;
      } else {
        recv_idx = static_cast<int>(n);
        fds[n++] = pollfd{fds_[static_cast<size_t>(from)], POLLIN, 0};
      }
    }
    int rc = yielding ? poll(fds, n, 0) : 0;
    if (rc == 0) {
      const Clock::time_point now = Clock::now();
      if (waiting_since == Clock::time_point{}) waiting_since = now;
      if (yielding && now - waiting_since < kYieldBudget) {
        sched_yield();
        continue;
      }
      rc = poll(fds, n, deadline.remaining_ms(kPollSliceMs));
    }
    waiting_since = Clock::time_point{};
    if (rc < 0) {
      if (errno == EINTR) continue;
      return Status(Code::kInternal, "poll: " + Errno(errno));
    }
    if (rc == 0) {
      if (deadline.expired()) {
        const int waited = received < recv_bytes ? from : to;
        const double silent = std::chrono::duration<double>(budget).count();
        char seconds[32];
        std::snprintf(seconds, sizeof seconds, "%.3g", silent);
        return Status(Code::kDeadlineExceeded,
                      std::string("timed out waiting for rank ") + std::to_string(waited) +
                          PeerWhere(fds_[static_cast<size_t>(waited)]) +
                          (received < recv_bytes ? " to send data" : " to accept data") +
                          ": nothing moved for " + seconds + " s",
                      waited);
      }
      continue;
    }
    if (recv_idx >= 0 && (fds[recv_idx].revents & (POLLIN | POLLHUP | POLLERR))) {
      ssize_t got = recv(fds[recv_idx].fd, rp + received, recv_bytes - received, MSG_DONTWAIT);
      // Our own abort shut the sockets down: that is no news about this peer.
      if (got <= 0 && abort_.aborted()) return abort_.WaitError();
      if (got == 0) return PeerGone(from, "receiving", 0);
      if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return PeerGone(from, "receiving", errno);
      }
      if (got > 0) {
        received += static_cast<size_t>(got);
        deadline = Deadline(Clock::now() + budget).Yielding(deadline.may_yield());
      }
      if (frame != nullptr && received == recv_bytes) {
        // The head is in: now the whole message, as long as it announces.
        KR_RETURN_IF_ERROR(
            FrameTotal(from, rp, recv_bytes, frame->capacity, *frame->length, frame->total));
        recv_bytes = *frame->total;
        frame = nullptr;
      }
    }
    if (send_idx >= 0 && (fds[send_idx].revents & (POLLOUT | POLLHUP | POLLERR))) {
      ssize_t put = send(fds[send_idx].fd, sp + sent, send_bytes - sent,
                         MSG_DONTWAIT | MSG_NOSIGNAL);
      if (put < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        if (abort_.aborted()) return abort_.WaitError();
        return PeerGone(to, "sending", errno);
      }
      if (put > 0) {
        sent += static_cast<size_t>(put);
        deadline = Deadline(Clock::now() + budget).Yielding(deadline.may_yield());
      }
    }
  }
  return Status::OK();
}

Status TcpTransport::PollPeerFailure() {
  if (abort_.aborted()) return Status::OK();
  std::vector<pollfd> fds;
  std::vector<int> peers;
  for (int peer = 0; peer < size_; ++peer) {
    const int fd = control_fds_[static_cast<size_t>(peer)];
    if (fd < 0) continue;
    fds.push_back(pollfd{fd, POLLIN | POLLRDHUP, 0});
    peers.push_back(peer);
  }
  if (fds.empty() || poll(fds.data(), fds.size(), 0) <= 0) return Status::OK();
  for (size_t i = 0; i < fds.size(); ++i) {
    if (fds[i].revents == 0) continue;
    Status s = ReadableNotice(peers[i]);
    if (!s.ok()) return s;
  }
  return Status::OK();
}

Status TcpTransport::PeerNotice(int peer) {
  const int fd = peer >= 0 && peer < size_ ? control_fds_[static_cast<size_t>(peer)] : -1;
  if (fd < 0) return Status::OK();
  pollfd p{fd, POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0 || p.revents == 0) return Status::OK();
  return ReadableNotice(peer);
}

Status TcpTransport::ReadableNotice(int peer) const {
  AbortNotice notice{};
  // Peek only: the data path may still read the notice to explain a failed transfer.
  const ssize_t got = recv(control_fds_[static_cast<size_t>(peer)], &notice, sizeof notice,
                           MSG_PEEK | MSG_DONTWAIT);
  if (got == static_cast<ssize_t>(sizeof notice) && notice.magic == kNoticeMagic) {
    if (static_cast<Code>(notice.code) == Code::kCancelled) return Status::OK();  // clean
    notice.message[sizeof notice.message - 1] = '\0';
    return PeerGaveUp(peer, static_cast<Code>(notice.code), notice.culprit, notice.message);
  }
  if (got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
    return Status(Code::kUnavailable,
                  "lost rank " + std::to_string(peer) +
                      ": its process exited, crashed or was killed without shutting down",
                  peer);
  }
  return Status::OK();
}

void TcpTransport::AbortWith(const Status& cause) {
  if (!abort_.Set(cause)) return;
  AbortNotice notice{kNoticeMagic, static_cast<int32_t>(cause.code()),
                     cause.peer() >= 0 ? cause.peer() : rank_, {}};
  std::snprintf(notice.message, sizeof notice.message, "%s", cause.message().c_str());
  for (int fd : control_fds_) {
    // Best effort: the control socket carries nothing else, so its buffer has room.
    if (fd >= 0) send(fd, &notice, sizeof notice, MSG_DONTWAIT | MSG_NOSIGNAL);
  }
  // Shutting the sockets down wakes any poll and shows peers an immediate EOF.
  for (size_t i = 0; i < fds_.size(); ++i) {
    if (fds_[i] >= 0) shutdown(fds_[i], SHUT_RDWR);
    if (control_fds_[i] >= 0) shutdown(control_fds_[i], SHUT_WR);
  }
}

}  // namespace keras_ring
