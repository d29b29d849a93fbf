// The collective runtime: one object per process, made by init and destroyed by shutdown. It
// orders and supervises; executors run. Requests execute strictly in submission order (one
// at a time, on the background worker or, when the runtime is idle, on the submitting
// thread), each by the executor for its placement: the host executor (signatures, inline
// data, ring over the transport) or the device executor (NCCL), made on first use. The
// device executor may defer a request's completion (launched on the GPU, completed later by
// its own thread through CompleteDeferred, in order); a host request first waits for those.
// A watchdog warns about stalls and watches the peers; the first fatal failure is kept and
// fails every later request.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "algorithms.h"
#include "common.h"
#include "executor.h"
#include "host_executor.h"
#include "request.h"
#include "timeline.h"
#include "transport.h"

namespace keras_ring {

struct RuntimeOptions {
  int rank = 0;
  int size = 1;
  double timeout_seconds = 300.0;
  double stall_warning_seconds = 60.0;  // <= 0 disables the warning
  size_t segment_bytes = 1 << 20;
  bool timeline = false;  // record phase times of every collective
  bool fast_agree = true;  // see AlgoConfig
  size_t doubling_max_bytes = 32 << 10;
  // After a fatal failure (own or a peer's), end the process this long after unless it
  // ended by itself (see failure_exit.h); <= 0: never.
  double failure_exit_seconds = 0.0;
  // Device collectives launched on the stream and not yet completed, at most (NCCL); the
  // next one waits for a slot. 1: each completes before the next launches.
  int device_max_in_flight = 64;
  // Whether the CPU kernels of collectives in graphs are synchronous (the TensorFlow adapter
  // reads it): TensorFlow then runs a collective's successor on the same thread instead of
  // scheduling it on its pool, which costs a hand-off per collective.
  bool sync_graph_kernels = true;
  // CPU outputs of at least this many bytes that a collective writes into fresh memory are
  // advised to use transparent huge pages (the TensorFlow adapter reads it); 0: never.
  size_t huge_page_output_bytes = 32 << 20;
  // A host collective that starts within this long of the end of this rank's previous one
  // is taken for part of a chain: its waits may yield the core (see FollowsClosely).
  double chain_gap_seconds = 200e-6;
};

// The error of a collective on a process set this rank runs no runtime for.
Status NoRuntimeError(int process_set);

// Whether this process was forked from a rank after init() (its runtimes are the parent's:
// it sees none), and the error that says so.
bool InForkedChild();
Status ForkedChildError();

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
  // Fails the job from outside any collective (the rendezvous found it may include another
  // job's process): what runs ends now and every later collective fails with `reason`, here
  // and, as a peer's failure, on the other ranks; the failure exit is armed. It stays
  // installed, so the program sees the reason in its next collective. Any thread.
  void FailJob(const std::string& reason);

  // Submits and waits (for the C API: barrier and tests).
  Status Run(Request request);

  // The failure of a peer that the watchdog noticed (also while this rank runs nothing),
  // or OK. Every later collective fails with it.
  Status PeerFailure();

  // The executor for device collectives, made by `make` on the first call (any thread). It
  // agrees on signatures through the host executor it is given.
  Executor* device_executor(const std::function<std::unique_ptr<Executor>(HostExecutor&)>& make);

  // The process-wide instance of a process set (0: all ranks), shared so kernels keep it
  // alive while they use it; null when this rank runs no such set.
  static std::shared_ptr<Runtime> Get(int process_set = 0);
  static void Install(std::shared_ptr<Runtime> runtime, int process_set = 0);
  static std::shared_ptr<Runtime> Uninstall(int process_set = 0);
  // Every set's runtime, process sets before the global one.
  static std::vector<std::shared_ptr<Runtime>> UninstallAll();

  // Completes a request that the device executor deferred (ExecutionStats::deferred), as the
  // executing thread would have: a failure becomes this runtime's error for it (and breaks
  // the runtime when fatal), the timeline records it, then its done runs. Any thread (the
  // device executor's completion thread); never with the executor's locks held.
  void CompleteDeferred(Request& request, uint64_t seq, const ExecutionStats& stats,
                        const Status& s);

  // Requests waiting to run (a hint: a device executor looks at a lone collective's
  // completion itself only while nothing else waits). Any thread.
  size_t queued() const { return queued_.load(); }

  // The stall warning the watchdog prints `waited_seconds` into the collective that runs:
  // whom this rank still waits on.
  std::string StallReport(double waited_seconds);

  // Recorded timeline events (empty unless recording), as tab-separated lines.
  std::string DrainTimeline() { return timeline_.Drain(); }
  // Starts as options.timeline says; marks and switching go through it.
  Timeline& timeline() { return timeline_; }

 private:
  void StopWith(const Status& requested);
  void WorkerLoop();
  // Executes one request (the caller holds executing_) and returns its result; done is not
  // called here. *deferred: the device executor took it and will complete it itself.
  Status RunOne(Request& request, bool* deferred);
  // Runs it on its executor and turns a failure into this runtime's error for it (`label`:
  // the request's, as errors name it).
  Status Execute(Request& request, uint64_t seq, const std::string& label,
                 ExecutionStats* stats);
  // Whether a host request starting at `started` follows this rank's previous collective
  // within options_.chain_gap_seconds: its waits may then yield the core
  // (Request::may_yield), as eager calls' do.
  bool FollowsClosely(const Request& request, Clock::time_point started) const;
  // `s` (not OK) as this runtime's error for `label`; a fatal one breaks the runtime. From
  // the executing thread (`executing`) or from a deferred completion.
  Status Failed(const std::string& label, const Status& bare, bool executing);
  // This rank gave up waiting for s.peer(), and has told it so. That peer may have been
  // waiting itself (still in an earlier collective, cut off from a rank that this one
  // heard from): its answer then passes the blame on (HostExecutor::PassOnBlame), and the
  // error says so. Waits a bounded moment for the answer; `s` unchanged without one.
  Status AskWhy(const Status& s, const std::string& label);
  std::string BusyLabel();
  Executor* DeviceExecutor();  // null until the first device collective
  // Warns about stalls and watches for peers that failed or died, also while idle.
  void WatchdogLoop();
  // A fatal failure: arms the process's failure exit.
  void OnFatal(const Status& cause);
  void RecordTimeline(const Request& r, uint64_t seq, Clock::time_point started,
                      const ExecutionStats& stats, const Status& s);
  // What peers are told of a clean shutdown: how many collectives this rank ran, and the
  // last one (a peer still waiting in a later one learns where the two parted).
  Status ShutdownCause();

  RuntimeOptions options_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<HostExecutor> host_;
  std::mutex device_mu_;
  std::unique_ptr<Executor> device_;

  // Marks a named request submitted while another of its name is pending here (concurrent
  // callers: Request::concurrent) and counts it until its done() runs.
  void TrackName(Request& request);
  void Enqueue(Request request);
  struct PendingNames {  // shared with each tracked done(), which a device may run late
    std::mutex mu;
    std::unordered_map<std::string, int> count;
  };
  std::shared_ptr<PendingNames> pending_names_ = std::make_shared<PendingNames>();

  std::mutex mu_;
  std::condition_variable cv_;  // the worker's: a request queued, executing_ cleared, a stop
  // The watchdog's own, woken only by a stop: sharing cv_ would wake it (and make it poll
  // every peer) on every collective.
  std::condition_variable watchdog_cv_;
  std::deque<Request> queue_;
  std::atomic<size_t> queued_{0};  // queue_.size(), readable without mu_
  bool stopping_ = false;
  Status stop_cause_;       // what peers are told when stopping_: a shutdown or a failure
  bool executing_ = false;  // a request runs, on the worker or on a caller's thread
  uint64_t seq_ = 0;        // of the last request run (only the executing thread touches it)
  std::atomic<uint64_t> ran_{0};  // seq_ once that request ended, for any thread to read
  Clock::time_point last_finished_;  // when it ended (as seq_, the executing thread's)
  Status broken_;  // first fatal error; every later request fails with it (executor only)
  Status peer_failure_;  // a peer's failure seen by the watchdog (guarded by mu_)
  Status deferred_failure_;  // a deferred request's fatal failure (guarded by mu_)
  std::thread worker_;

  // What the executing thread is doing, for the stall watchdog (which only reads these).
  std::atomic<uint64_t> busy_seq_{0};      // 0 while idle
  std::atomic<int64_t> busy_since_ns_{0};  // steady clock
  std::mutex label_mu_;
  std::string busy_label_;
  std::thread watchdog_;

  Timeline timeline_;
};

}  // namespace keras_ring
