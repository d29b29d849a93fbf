#include "tcp_transport.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

namespace keras_ring {
namespace {

constexpr uint64_t kHelloMagic = 0x6b72696e67686921ull;  // "kringhi!"
constexpr int kPollSliceMs = 200;  // wake up this often to notice Abort()

struct Hello {
  uint64_t magic;
  uint64_t job_token;
  int32_t rank;
  int32_t size;
};

void SetSocketOptions(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
}

std::string Errno(int err) { return std::strerror(err); }

}  // namespace

Status TcpTransport::Create(int rank, int size, int listen_fd,
                            const std::vector<PeerAddress>& peers, uint64_t job_token,
                            Deadline deadline, std::unique_ptr<TcpTransport>* out) {
  if (static_cast<int>(peers.size()) != size) {
    return Status(Code::kInvalidArgument, "peer table has " + std::to_string(peers.size()) +
                                              " entries for " + std::to_string(size) + " ranks");
  }
  std::unique_ptr<TcpTransport> t(new TcpTransport(rank, size));
  // Lower ranks first: every rank connects downward and accepts upward, so no cycle waits.
  for (int peer = 0; peer < rank; ++peer) {
    KR_RETURN_IF_ERROR(t->ConnectTo(peer, peers[static_cast<size_t>(peer)], job_token, deadline));
  }
  // Higher ranks connect in any order; each accept takes whichever comes.
  for (int n = rank + 1; n < size; ++n) {
    KR_RETURN_IF_ERROR(t->AcceptFrom(listen_fd, job_token, deadline));
  }
  for (int fd : t->fds_) {
    if (fd >= 0) SetSocketOptions(fd);
  }
  *out = std::move(t);
  return Status::OK();
}

TcpTransport::~TcpTransport() {
  for (int fd : fds_) {
    if (fd >= 0) close(fd);
  }
}

Status TcpTransport::ConnectTo(int peer, const PeerAddress& addr, uint64_t job_token,
                               Deadline deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(addr.port);
  int rc = getaddrinfo(addr.host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    return Status(Code::kUnavailable, "cannot resolve address '" + addr.host + "' of rank " +
                                          std::to_string(peer) + ": " + gai_strerror(rc), peer);
  }
  std::string last_error = "no address";
  // The peer listens before addresses are exchanged, so failures here are transient at most.
  while (true) {
    for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
      int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
      if (fd < 0) continue;
      if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
        Hello hello{kHelloMagic, job_token, rank_, size_};
        fds_[static_cast<size_t>(peer)] = fd;
        Status s = Send(peer, &hello, sizeof hello, deadline);
        freeaddrinfo(res);
        if (!s.ok()) return s;
        return Status::OK();
      }
      last_error = Errno(errno);
      close(fd);
    }
    if (deadline.expired()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // retry back-off, not a race fix
  }
  freeaddrinfo(res);
  return Status(Code::kDeadlineExceeded, "could not connect to rank " + std::to_string(peer) +
                                             " at " + addr.host + ":" + port + ": " + last_error,
                peer);
}

Status TcpTransport::AcceptFrom(int listen_fd, uint64_t job_token, Deadline deadline) {
  while (true) {
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
                      "timed out waiting for rank " + std::to_string(missing) + " to connect",
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
    if (got != static_cast<ssize_t>(sizeof hello) || hello.magic != kHelloMagic ||
        hello.job_token != job_token || hello.size != size_ || hello.rank <= rank_ ||
        hello.rank >= size_ || fds_[static_cast<size_t>(hello.rank)] >= 0) {
      close(fd);  // not one of ours
      continue;
    }
    timeval zero{0, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &zero, sizeof zero);
    fds_[static_cast<size_t>(hello.rank)] = fd;
    return Status::OK();
  }
}

Status TcpTransport::PeerGone(int peer, const char* what, int err) const {
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
  const char* sp = static_cast<const char*>(send_data);
  char* rp = static_cast<char*>(recv_data);
  size_t sent = 0, received = 0;
  while (sent < send_bytes || received < recv_bytes) {
    if (aborted_.load()) return Status(Code::kAborted, "keras_ring runtime was aborted");
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
    int rc = poll(fds, n, deadline.remaining_ms(kPollSliceMs));
    if (rc < 0) {
      if (errno == EINTR) continue;
      return Status(Code::kInternal, "poll: " + Errno(errno));
    }
    if (rc == 0) {
      if (deadline.expired()) {
        const int waited = received < recv_bytes ? from : to;
        return Status(Code::kDeadlineExceeded,
                      std::string("timed out waiting for rank ") + std::to_string(waited) +
                          (received < recv_bytes ? " to send data" : " to accept data"),
                      waited);
      }
      continue;
    }
    if (recv_idx >= 0 && (fds[recv_idx].revents & (POLLIN | POLLHUP | POLLERR))) {
      ssize_t got = recv(fds[recv_idx].fd, rp + received, recv_bytes - received, MSG_DONTWAIT);
      if (got == 0) return PeerGone(from, "receiving", 0);
      if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return PeerGone(from, "receiving", errno);
      }
      if (got > 0) received += static_cast<size_t>(got);
    }
    if (send_idx >= 0 && (fds[send_idx].revents & (POLLOUT | POLLHUP | POLLERR))) {
      ssize_t put = send(fds[send_idx].fd, sp + sent, send_bytes - sent,
                         MSG_DONTWAIT | MSG_NOSIGNAL);
      if (put < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return PeerGone(to, "sending", errno);
      }
      if (put > 0) sent += static_cast<size_t>(put);
    }
  }
  return Status::OK();
}

void TcpTransport::Abort() {
  aborted_.store(true);
  // Shutting the sockets down wakes any poll and shows peers an immediate EOF.
  for (int fd : fds_) {
    if (fd >= 0) shutdown(fd, SHUT_RDWR);
  }
}

}  // namespace keras_ring
