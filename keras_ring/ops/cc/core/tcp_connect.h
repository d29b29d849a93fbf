// Connecting to a peer that offers several addresses: the first to answer wins. Addresses
// are started in order, the next one after a short stagger while none has answered (RFC
// 8305's idea), so a silent address (a firewalled or unrouted interface) costs the stagger,
// not a whole connect timeout.
#pragma once

#include <sys/socket.h>

#include <string>
#include <vector>

#include "common.h"

namespace keras_ring {

struct ConnectTarget {
  size_t candidate;  // which of the offered addresses it came from
  sockaddr_storage addr;
  socklen_t len;
};

struct ConnectOutcome {
  int fd = -1;            // the connected socket (blocking), or -1
  size_t winner = 0;      // index into the targets of `fd`
  std::vector<int> errs;  // per target: errno of its attempt (0: not started or won)
};

// Connects to the first of `targets` that accepts. Each attempt is bounded by `attempt_ms`
// and all by `deadline`; the socket that wins is returned, the rest are closed.
ConnectOutcome ConnectFirst(const std::vector<ConnectTarget>& targets, int stagger_ms,
                            int attempt_ms, Deadline deadline);

// Resolves `host` (a name or a numeric address) at `port`; appends what it resolves to as
// targets of `candidate`. Returns "" or the resolver's error.
std::string Resolve(const std::string& host, int port, size_t candidate,
                    std::vector<ConnectTarget>* out);

}  // namespace keras_ring
