// The collective runtime: one object per process, made by init and destroyed by shutdown.
// It owns the transport and one background worker that executes requests strictly in
// submission order, so every rank runs the same collectives in the same order. When nothing
// is queued, a submitting thread may run its request itself (SubmitOrRun); one request runs
// at a time either way.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "algorithms.h"
#include "common.h"
#include "signature.h"
#include "timeline.h"
#include "transport.h"

namespace keras_ring {

struct TensorRef {
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
  const void* input = nullptr;
  void* output = nullptr;  // may equal input (in place); null for allgather until allocated
  int64_t num_elements() const;
  size_t num_bytes() const { return static_cast<size_t>(num_elements()) * DataTypeSize(dtype); }
};

// One collective as submitted by a kernel (or the C API). `done` is called exactly once,
// from the worker thread (or from Submit when the runtime cannot take it).
struct Request {
  Kind kind = Kind::kAllreduce;
  std::string name;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  double prescale = 1.0;
  double postscale = 1.0;
  std::vector<TensorRef> tensors;
  // Allgather only: allocates the output for `total_rows` rows; sets tensors[0].output.
  std::function<Status(int64_t total_rows, void** output)> allocate_output;
  // Set for tensors in device memory (GPU): after the signatures agree, the worker calls
  // this instead of the host algorithms, still in submission order. It gets the host
  // transport as a control channel (e.g. to distribute an NCCL unique id) and every rank's
  // signature. Device data is never inlined into the exchange.
  std::function<Status(Transport& control, const std::vector<Signature>& all)> run_on_device;
  std::function<void(const Status&)> done;
  Clock::time_point submitted{};  // set by Submit, for the timeline
};

// Collectives on device memory (the NCCL backend) keep their state here, owned by the runtime
// so that it lives exactly as long as the runtime: Abort() runs as shutdown begins (a
// collective in flight ends at once), and the object is destroyed after the worker stopped.
class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual void Abort() = 0;  // shutdown began: end any wait now (thread-safe)
  // The host data plane failed (a peer may be gone): release device resources without
  // waiting for peers. Called on the worker.
  virtual void PeerFailed() {}
};

struct RuntimeOptions {
  int rank = 0;
  int size = 1;
  double timeout_seconds = 300.0;
  double stall_warning_seconds = 60.0;  // <= 0 disables the warning
  size_t segment_bytes = 1 << 20;
  bool timeline = false;  // record phase times of every collective
  // After a fatal failure (own or a peer's), end the process this long after unless it
  // ended by itself (see failure_exit.h); <= 0: never.
  double failure_exit_seconds = 0.0;
};

class Runtime {
 public:
  Runtime(const RuntimeOptions& options, std::unique_ptr<Transport> transport);
  ~Runtime();  // fails queued requests, stops the worker, closes the transport
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  int rank() const { return options_.rank; }
  int size() const { return options_.size; }
  const RuntimeOptions& options() const { return options_; }

  // Queues the request; never blocks on the network.
  void Submit(Request request);

  // Runs the request on the calling thread when nothing is queued or running (else queues
  // it like Submit). A collective then costs no thread hand-offs: TensorFlow finishes an op
  // whose done() runs inside ComputeAsync far faster than one completed from another thread.
  // The caller blocks until the collective ends (bounded by the timeout).
  void SubmitOrRun(Request request);

  // Fails what is queued and aborts what runs, so a collective running on a caller's thread
  // ends now too; peers learn that this rank shut down. Idempotent; the destructor calls it.
  void Stop();
  // Stop() for a program that is leaving with an error: peers learn it as this rank's
  // failure (they end instead of waiting for it), and this process's failure exit is armed.
  void Abandon(const std::string& reason);

  // Submits and waits (for the C API: barrier and tests).
  Status Run(Request request);

  // The failure of a peer that the watchdog noticed (also while this rank runs nothing),
  // or OK. Every later collective fails with it.
  Status PeerFailure();

  // The process-wide instance, shared so kernels keep it alive while they use it.
  static std::shared_ptr<Runtime> Get();
  static void Install(std::shared_ptr<Runtime> runtime);
  static std::shared_ptr<Runtime> Uninstall();

  // This runtime's device backend, made by `make` on the first call (any thread).
  DeviceBackend* device_backend(const std::function<std::unique_ptr<DeviceBackend>()>& make);

  // Recorded timeline events (empty unless options.timeline), as tab-separated lines.
  std::string DrainTimeline() { return timeline_.Drain(); }

 private:
  void StopWith(const Status& cause);
  void WorkerLoop();
  // Executes one request (the caller holds executing_) and returns its result; done is not
  // called here.
  Status RunOne(Request& request);
  // Warns about stalls and watches for peers that failed or died, also while idle.
  void WatchdogLoop();
  // A fatal failure: arms the process's failure exit (and, from the watchdog, aborts).
  void OnFatal(const Status& cause);
  void RecordTimeline(const Request& r, uint64_t seq, Clock::time_point started,
                      const Status& s);
  std::string StallReport(double waited_seconds);
  Status Execute(Request& request, uint64_t seq);
  Status ExecuteAllreduce(Request& request);
  Status ExecuteGrouped(Request& request);
  Status ExecuteAllgather(Request& request, const std::vector<Signature>& sigs);
  // Packs this rank's data into its slot when it fits; returns whether it did.
  bool PackInline(const Request& request, Slot* slot) const;
  // Completes a collective whose data every rank inlined in the exchanged slots.
  Status ExecuteInline(Request& request, const std::vector<Signature>& sigs);
  void ReduceInline(const Request& r, DataType dtype, size_t offset, size_t count, void* out);
  Status ExecuteBroadcast(Request& request);
  Signature MakeSignature(const Request& request, uint64_t seq) const;
  Status Fail(const Request& request, uint64_t seq, const Status& cause);
  Status ShutdownCause() const;
  Status BlameForExchangeTimeout(const Request& request, uint64_t seq, int steps) const;

  RuntimeOptions options_;
  std::unique_ptr<Transport> transport_;
  AlgoConfig algo_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Request> queue_;
  bool stopping_ = false;
  Status stop_cause_;  // what peers are told when stopping_: a shutdown or a failure
  bool executing_ = false;  // a request runs, on the worker or on a caller's thread
  uint64_t seq_ = 0;        // of the last request run (only the executing thread touches it)
  Status broken_;  // first fatal error; every later request fails with it (executor only)
  Status peer_failure_;  // a peer's failure seen by the watchdog (guarded by mu_)
  std::vector<char> scratch_;  // prescaled peer data on the inline path (worker only)
  std::vector<Slot> slots_;    // one per rank, reused by every exchange (worker only)
  std::thread worker_;

  // What the worker is doing, for the stall watchdog (which only reads these).
  std::atomic<uint64_t> busy_seq_{0};       // 0 while idle
  std::atomic<int64_t> busy_since_ns_{0};   // steady clock
  std::atomic<int> exchange_steps_{-1};     // ring steps of the slot exchange; -1 after it
  std::mutex label_mu_;
  std::string busy_label_;
  std::thread watchdog_;

  Timeline timeline_;
  std::mutex backend_mu_;
  std::unique_ptr<DeviceBackend> backend_;
  Clock::time_point exchanged_at_{};  // when the current collective's exchange finished
  bool inlined_ = false;              // whether it completed inside the exchange
};

}  // namespace keras_ring
