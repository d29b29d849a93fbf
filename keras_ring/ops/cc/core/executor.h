// What runs a collective once the runtime, which orders and supervises, hands it over. The
// host executor runs collectives on host memory (signature exchange, inline data, ring
// algorithms over the Transport); the NCCL executor runs those on device memory. The
// runtime picks one by the request's placement; both agree on signatures the same way.
#pragma once

#include <cstdint>

#include "request.h"

namespace keras_ring {

// What a run recorded for the timeline.
struct ExecutionStats {
  Clock::time_point agreed{};  // when the signatures had been exchanged
  bool inlined = false;        // completed inside the exchange (small data)
  uint64_t extra_seqs = 0;     // join: the others' collectives it took part in
};

class Executor {
 public:
  virtual ~Executor() = default;
  // Runs `request`, the `seq`-th collective of this runtime: agrees on signatures with the
  // peers, then moves the data. Returns the bare cause of a failure (the runtime labels it);
  // a fatal status means the data plane can no longer be trusted.
  virtual Status Execute(Request& request, uint64_t seq, ExecutionStats* stats) = 0;
  // Shutdown began: end any wait now. Any thread.
  virtual void Abort() {}
  // A peer failed or is gone, or the host data plane failed (`cause` says which): end any
  // wait on peers with it, and tear down without their cooperation. Any thread (the worker,
  // or the watchdog while the worker waits on the device).
  virtual void PeerFailed(const Status& /*cause*/) {}
};

}  // namespace keras_ring
