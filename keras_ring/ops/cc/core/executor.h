// What runs a collective once the runtime, which orders and supervises, hands it over. The
// host executor runs collectives on host memory (signature exchange, inline data, ring
// algorithms over the Transport); the NCCL executor runs those on device memory. The
// runtime picks one by the request's placement; both agree on signatures the same way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "request.h"

namespace keras_ring {

// What a run recorded for the timeline.
struct ExecutionStats {
  Clock::time_point started{};  // when the runtime handed it over
  Clock::time_point agreed{};  // when the signatures had been exchanged
  bool inlined = false;        // completed inside the exchange (small data)
  uint64_t extra_seqs = 0;     // join: the others' collectives it took part in
  // The executor took the request (moved it out, done included) and completes it later
  // through the runtime's CompleteDeferred: a device collective in flight on its stream.
  bool deferred = false;
};

// The requests queued behind the one executing, oldest first: calls `visit` on each until it
// returns false. The runtime's, run under its queue lock: `visit` reads, takes no lock of
// the runtime, and keeps no reference.
using QueuePeek = std::function<void(const std::function<bool(const Request&)>& visit)>;

class Executor {
 public:
  virtual ~Executor() = default;
  // How the executor may look at what is queued behind the request it runs (the runtime
  // sets it once, before the first Execute). Only the executing thread calls it.
  virtual void SetQueuePeek(QueuePeek /*peek*/) {}
  // Collectives this rank agreed with its peers to run (a lookahead) that have not reached
  // Execute yet: the peers may already run theirs. Any thread.
  virtual size_t Committed() const { return 0; }
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
  // Returns once every request this executor deferred has completed (done called). Called
  // by the runtime before a request that must not overtake them (a host collective).
  // Bounded: each deferred request ends by its deadline. Never called with a lock held.
  virtual void Drain() {}
};

}  // namespace keras_ring
