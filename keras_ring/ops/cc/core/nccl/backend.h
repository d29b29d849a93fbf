// The NCCL backend: the runtime's executor for collectives on device memory (placement
// kDevice). It agrees on signatures through the host executor, then runs NCCL.
//
// Ordering without host synchronisation of the caller's stream: at submission an event is
// recorded on the caller's stream (TensorFlow's compute stream); the runtime's own stream
// waits for it, runs the NCCL call, records a second event, and the caller's stream waits for
// that one.
//
// Completion off the critical path (inflight.cc): the worker agrees on signatures and
// launches, then hands the collective to the completion thread and goes on with the next one,
// so up to `max_in_flight` collectives are queued on the stream at once (their order there is
// their submission order). The completion thread polls the oldest one's event (with
// ncclCommGetAsyncError, the deadline of its launch, shutdown and the host transport's view
// of the peers) and completes them in order through the runtime; their done runs only once
// the result is in place. The first failure aborts the communicators and fails it and every
// collective behind it; the worker's next launch sees it. A collective that completes on the
// worker (a barrier, nothing to move, an error) first waits until those in flight completed,
// so completions keep submission order.
//
// Communicators: one per device, made at the first collective on it. Which one a collective
// uses is part of its signature. Every rank first says whether it can take part (libraries
// found, device usable), so a rank without NCCL makes all ranks fail alike instead of
// hanging; then rank 0's ncclUniqueId is broadcast over the host transport, in order, like
// any collective. Every NCCL call that may still be running (setup, launches, teardown) is
// polled against the deadline, shutdown and the host transport's view of the peers, and the
// communicator is aborted when the wait ends early. Finalized and destroyed with the runtime.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "../executor.h"
#include "../host_executor.h"
#include "../runtime.h"
#include "communicator.h"
#include "device_api.h"
#include "plan.h"

namespace keras_ring {
namespace nccl {

class NcclBackend;

// What a device collective carries from submission (the caller's thread) to execution (the
// worker): where its inputs are ready. Returns its event to the backend when dropped.
struct StreamTicket : DeviceTicket {
  StreamTicket(NcclBackend* owner, int device, Stream caller_stream)
      : owner(owner), device(device), caller_stream(caller_stream) {}
  ~StreamTicket() override;
  StreamTicket(const StreamTicket&) = delete;
  StreamTicket& operator=(const StreamTicket&) = delete;

  NcclBackend* owner;
  int device;
  Stream caller_stream;
  Event ready = nullptr;  // recorded on caller_stream at submission
  Status status;          // why the submission could not prepare, reported collectively
};

// What a collective's NCCL calls need, decided from the agreed signatures alone (so every
// rank decides alike) before the first NCCL call.
struct LaunchPlan {
  std::vector<ReducePlan> reduce;  // allreduce: one per tensor; reducescatter: one
  ExchangePlan exchange;           // alltoall
};

// How a deferred collective is completed: Runtime::CompleteDeferred.
using Completion =
    std::function<void(Request& request, uint64_t seq, const ExecutionStats& stats,
                       const Status& s)>;
// Whether requests wait to run behind the one executing: Runtime::queued() > 0.
using WorkWaiting = std::function<bool()>;

class NcclBackend : public Executor {
 public:
  NcclBackend(std::shared_ptr<DeviceApi> api, HostExecutor& host, int rank, int size,
              double timeout_seconds, int max_in_flight, Completion complete,
              WorkWaiting work_waiting);
  // After the worker stopped: completes what is still in flight (aborted by the shutdown
  // that came first), finalizes and destroys the communicators (aborts them after a failure,
  // or when the peers do not finish within the deadline), then the streams and events.
  ~NcclBackend() override;
  void Abort() override;
  void PeerFailed(const Status& cause) override;
  void Drain() override;

  // On the submitting thread: records where `caller_stream`'s inputs are ready.
  std::shared_ptr<StreamTicket> Prepare(int device, Stream caller_stream);

  // On the worker, in submission order: agree on signatures (host executor), then run.
  Status Execute(Request& request, uint64_t seq, ExecutionStats* stats) override;
  void SetQueuePeek(QueuePeek peek) override { peek_ = std::move(peek); }
  size_t Committed() const override { return committed_.load(); }

  int communicator_count();
  int64_t events_made() const { return events_made_.load(); }  // each is reused once made
  void ReleaseEvent(int device, Event event);
  // The most collectives that were in flight at once (launched, not yet completed).
  int max_in_flight_seen();
  // Rounds of agreement run with the peers; collectives agreed by an earlier round's
  // lookahead run without one.
  int64_t agreement_rounds() const { return agreement_rounds_.load(); }

 private:
  // A launched collective on its way to completion (inflight.cc).
  struct InFlight {
    Request request;
    uint64_t seq = 0;
    ExecutionStats stats;
    int device = -1;
    Event done = nullptr;       // recorded on the runtime's stream after the launch
    Event allocated = nullptr;  // allgather, alltoall: where the output was allocated
    Deadline deadline{Clock::time_point{}};
    std::string what;  // "NCCL allreduce"
  };

  struct DeviceState {
    Stream stream = nullptr;  // the runtime's own stream on this device (worker only)
    std::unique_ptr<Communicator> comm;
    int ordinal = -1;                // of comm, in the order communicators were made
    std::vector<Event> free_events;  // guarded by mu_
  };

  DeviceState& State(int device);
  DeviceComm CommunicatorFor(int device);
  // lookahead.cc: `request`'s agreement, taken from an earlier round's lookahead, or a
  // round of its own that also agrees the device collectives queued behind it.
  Status AgreeAhead(const Request& request, uint64_t seq, std::vector<Signature>* sigs);
  // The queued collectives that may be agreed with `request` (same GPU, its communicator
  // made), with the seqs and communicator they will run with.
  void PeekAhead(const Request& request, uint64_t seq, FastLookahead* ahead);
  // This rank can run NCCL on the ticket's device: communicator made (collectively) if new.
  Status Run(Transport& control, const std::vector<Signature>& sigs, Request& c,
             StreamTicket& ticket, uint64_t seq, ExecutionStats* stats);
  Status Ready(Transport& control, StreamTicket& ticket);
  Status Plan(const std::vector<Signature>& sigs, Request& c, LaunchPlan* plan);
  // Launches on the runtime's stream and defers the request (moves it in flight).
  Status RunOnStream(const std::vector<Signature>& sigs, Request& c, const LaunchPlan& plan,
                     StreamTicket& ticket, DeviceState& d, uint64_t seq, ExecutionStats* stats);
  Status LaunchOnStream(const std::vector<Signature>& sigs, Request& c, const LaunchPlan& plan,
                        StreamTicket& ticket, DeviceState& d, const StopCheck& stop,
                        Event* allocated, Event* done);
  Status TakeEvent(int device, Event* event);
  Status Connect(Transport& control, int device, const Status& local);
  Status Launch(const std::vector<Signature>& sigs, Request& c, const LaunchPlan& plan,
                Communicator& comm, Stream stream, const StopCheck& stop);
  Status LaunchReduce(Request& c, const std::vector<ReducePlan>& plans, Communicator& comm,
                      Stream stream, const StopCheck& stop);
  Status LaunchAllgather(const std::vector<Signature>& sigs, Request& c, Communicator& comm,
                         Stream stream, const StopCheck& stop);
  // scatter.cc: reducescatter and alltoall.
  Status LaunchReducescatter(Request& c, const ReducePlan& plan, Communicator& comm,
                             Stream stream, const StopCheck& stop);
  Status LaunchAlltoall(Request& c, const ExchangePlan& plan, Communicator& comm, Stream stream,
                        const StopCheck& stop);
  // inflight.cc: the depth limit, the hand-over and the completion thread.
  Status WaitForSlot(const StopCheck& stop);
  void Defer(InFlight entry);
  void CompletionLoop();
  Status Poll(InFlight& f, int* current_device);
  // Records the first failure of a collective in flight, aborts every communicator, and
  // returns `cause` saying so.
  Status FailInFlight(const Status& cause);
  void Finish(InFlight& f, const Status& s);
  bool OnCompletionThread() const;
  Status GpuFailure();  // the recorded failure, or OK
  // Stops a wait at `deadline`, at shutdown, on a signal, when a peer failed or when a
  // collective in flight failed.
  StopCheck StopAt(const Deadline& deadline);
  Status StopReason(const Deadline& deadline, const std::string& what,
                    Clock::time_point* next_liveness_poll);
  // A failed peer (from the watchdog, or seen here on the host transport, looked at by each
  // thread at most every 10 ms: `next_poll` is that thread's), or OK.
  Status PeerFailure(Clock::time_point* next_poll);
  void ReleaseCommunicators();
  Status Cuda(int error, const char* call);
  Status Nccl(int result, const char* call);
  Status Grouped(int result, const char* call);

  std::shared_ptr<DeviceApi> api_;
  HostExecutor& host_;
  const int rank_;
  const int size_;
  const double timeout_seconds_;
  const size_t max_in_flight_;
  const Completion complete_;
  const WorkWaiting work_waiting_;
  std::atomic<int64_t> events_made_{0};
  std::atomic<bool> aborted_{false};
  std::atomic<bool> peer_failed_{false};
  std::mutex failure_mu_;
  Status peer_failure_;                         // guarded by failure_mu_
  Clock::time_point next_liveness_poll_{};      // worker only
  int communicators_made_ = 0;                  // worker only
  QueuePeek peek_;                              // set before the first Execute
  std::deque<Signature> pre_agreed_;            // executing thread only; seq order
  std::atomic<size_t> committed_{0};            // pre_agreed_.size(), for any thread
  std::atomic<int64_t> agreement_rounds_{0};
  std::mutex mu_;
  std::map<int, DeviceState> devices_;  // node-based: references stay valid
  // Held around every call on a communicator once it exists (launches on the worker; async
  // error polls and aborts on the completion thread): ncclCommAbort frees it.
  std::mutex comm_mu_;

  // Collectives in flight, oldest first; only the completion thread pops, after completing.
  std::mutex flight_mu_;
  std::condition_variable flight_cv_;
  std::deque<InFlight> in_flight_;  // guarded by flight_mu_
  size_t max_seen_ = 0;             // guarded by flight_mu_
  bool stopping_ = false;           // guarded by flight_mu_
  std::atomic<bool> gpu_failed_{false};
  Status gpu_failure_;  // guarded by failure_mu_
  std::thread completer_;
};

// Makes `request` a device collective on `runtime`'s NCCL backend (its device executor,
// created on first use with `api`): records the ready point on `caller_stream` now.
void AttachNccl(Runtime& runtime, int device, Stream caller_stream, Request* request,
                const std::shared_ptr<DeviceApi>& api = SystemDeviceApi());

}  // namespace nccl
}  // namespace keras_ring
