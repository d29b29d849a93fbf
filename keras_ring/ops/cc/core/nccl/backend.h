// The NCCL backend: the runtime's executor for collectives on device memory (placement
// kDevice). It agrees on signatures through the host executor, then runs NCCL.
//
// Ordering without host synchronisation of the caller's stream: at submission an event is
// recorded on the caller's stream (TensorFlow's compute stream); the runtime's own stream
// waits for it, runs the NCCL call, records a second event, and the caller's stream waits for
// that one. The worker then polls the second event (with ncclCommGetAsyncError and the
// runtime's deadline) before the collective is reported done, so every wait is bounded and an
// NCCL failure or stall reaches the op that caused it, with the communicator aborted.
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
#include <map>
#include <memory>
#include <mutex>
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

class NcclBackend : public Executor {
 public:
  NcclBackend(std::shared_ptr<DeviceApi> api, HostExecutor& host, int rank, int size,
              double timeout_seconds);
  // After the worker stopped: finalizes and destroys the communicators (aborts them after a
  // failure, or when the peers do not finish within the deadline), then the streams and
  // events.
  ~NcclBackend() override;
  void Abort() override;
  void PeerFailed(const Status& cause) override;

  // On the submitting thread: records where `caller_stream`'s inputs are ready.
  std::shared_ptr<StreamTicket> Prepare(int device, Stream caller_stream);

  // On the worker, in submission order: agree on signatures (host executor), then run.
  Status Execute(Request& request, uint64_t seq, ExecutionStats* stats) override;

  int communicator_count();
  int64_t events_made() const { return events_made_.load(); }  // each is reused once made
  void ReleaseEvent(int device, Event event);

 private:
  struct DeviceState {
    Stream stream = nullptr;  // the runtime's own stream on this device (worker only)
    std::unique_ptr<Communicator> comm;
    int ordinal = -1;                // of comm, in the order communicators were made
    std::vector<Event> free_events;  // guarded by mu_
  };

  DeviceState& State(int device);
  DeviceComm CommunicatorFor(int device);
  // This rank can run NCCL on the ticket's device: communicator made (collectively) if new.
  Status Run(Transport& control, const std::vector<Signature>& sigs, Request& c,
             StreamTicket& ticket);
  Status Ready(Transport& control, StreamTicket& ticket);
  Status Plan(const std::vector<Signature>& sigs, Request& c, LaunchPlan* plan);
  Status RunOnStream(const std::vector<Signature>& sigs, Request& c, const LaunchPlan& plan,
                     StreamTicket& ticket, DeviceState& d);
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
  Status WaitFor(Event done, Communicator& comm, const std::string& what,
                 const StopCheck& stop);
  // Stops a wait at `deadline`, at shutdown, on a signal or when a peer failed.
  StopCheck StopAt(const Deadline& deadline);
  Status StopReason(const Deadline& deadline, const std::string& what);
  // A failed peer (from the watchdog, or seen here on the host transport), or OK.
  Status PeerFailure();
  void ReleaseCommunicators();
  Status Cuda(int error, const char* call);
  Status Nccl(int result, const char* call);
  Status Grouped(int result, const char* call);

  std::shared_ptr<DeviceApi> api_;
  HostExecutor& host_;
  const int rank_;
  const int size_;
  const double timeout_seconds_;
  std::atomic<int64_t> events_made_{0};
  std::atomic<bool> aborted_{false};
  std::atomic<bool> peer_failed_{false};
  std::mutex failure_mu_;
  Status peer_failure_;                         // guarded by failure_mu_
  Clock::time_point next_liveness_poll_{};      // worker only
  int communicators_made_ = 0;                  // worker only
  std::mutex mu_;
  std::map<int, DeviceState> devices_;  // node-based: references stay valid
};

// Makes `request` a device collective on `runtime`'s NCCL backend (its device executor,
// created on first use with `api`): records the ready point on `caller_stream` now.
void AttachNccl(Runtime& runtime, int device, Stream caller_stream, Request* request,
                const std::shared_ptr<DeviceApi>& api = SystemDeviceApi());

}  // namespace nccl
}  // namespace keras_ring
