#include "tcp_connect.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace keras_ring {
namespace {

struct Attempt {
  size_t target;
  int fd;
  Clock::time_point started;
};

// Starts a non-blocking connect; returns its socket, or -1 with *err set.
int StartConnect(const ConnectTarget& t, int* err) {
  const int fd = socket(t.addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  if (connect(fd, reinterpret_cast<const sockaddr*>(&t.addr), t.len) != 0 &&
      errno != EINPROGRESS) {
    *err = errno;
    close(fd);
    return -1;
  }
  return fd;
}

int MsUntil(Clock::time_point t) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
  return static_cast<int>(std::max<int64_t>(0, ms));
}

}  // namespace

ConnectOutcome ConnectFirst(const std::vector<ConnectTarget>& targets, int stagger_ms,
                            int attempt_ms, Deadline deadline) {
  ConnectOutcome out;
  out.errs.assign(targets.size(), 0);
  std::vector<Attempt> live;
  size_t next = 0;
  Clock::time_point next_start = Clock::now();
  while (true) {
    // Start the next address when its turn has come, or at once when nothing is pending.
    while (next < targets.size() && (live.empty() || Clock::now() >= next_start)) {
      const int fd = StartConnect(targets[next], &out.errs[next]);
      if (fd >= 0) live.push_back({next, fd, Clock::now()});
      next_start = Clock::now() + std::chrono::milliseconds(stagger_ms);
      ++next;
    }
    if (live.empty() || deadline.expired()) break;
    Clock::time_point wake = deadline.time();
    if (next < targets.size()) wake = std::min(wake, next_start);
    for (const Attempt& a : live) {
      wake = std::min(wake, a.started + std::chrono::milliseconds(attempt_ms));
    }
    std::vector<pollfd> fds;
    for (const Attempt& a : live) fds.push_back({a.fd, POLLOUT, 0});
    const int rc = poll(fds.data(), fds.size(), MsUntil(wake));
    if (rc < 0 && errno != EINTR) break;
    std::vector<Attempt> still;
    for (size_t i = 0; i < live.size(); ++i) {
      const Attempt& a = live[i];
      int err = 0;
      if (fds[i].revents != 0) {
        socklen_t len = sizeof err;
        getsockopt(a.fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err == 0 && out.fd < 0) {
          out.fd = a.fd;
          out.winner = a.target;
          continue;
        }
      } else if (Clock::now() >= a.started + std::chrono::milliseconds(attempt_ms)) {
        err = ETIMEDOUT;
      } else {
        still.push_back(a);
        continue;
      }
      if (err != 0) out.errs[a.target] = err;
      close(a.fd);
    }
    live.swap(still);
    if (out.fd >= 0) break;
  }
  for (const Attempt& a : live) {
    if (out.fd < 0) out.errs[a.target] = ETIMEDOUT;  // the deadline passed while it tried
    if (a.fd != out.fd) close(a.fd);
  }
  if (out.fd >= 0) fcntl(out.fd, F_SETFL, fcntl(out.fd, F_GETFL, 0) & ~O_NONBLOCK);
  return out;
}

std::string Resolve(const std::string& host, int port, size_t candidate,
                    std::vector<ConnectTarget>* out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) return std::string("cannot resolve: ") + gai_strerror(rc);
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    ConnectTarget t{candidate, {}, static_cast<socklen_t>(ai->ai_addrlen)};
    std::memcpy(&t.addr, ai->ai_addr, ai->ai_addrlen);
    out->push_back(t);
  }
  freeaddrinfo(res);
  return "";
}

}  // namespace keras_ring
