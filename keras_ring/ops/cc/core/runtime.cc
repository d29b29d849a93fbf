#include "runtime.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>

#include "doubling.h"
#include "failure_exit.h"

namespace keras_ring {
namespace {


// In a child forked from a rank after init(), the runtimes it copied are the parent's: their
// threads did not come along, and their connections and shared memory are the parent's. A
// collective there paired with a peer's collective of the parent's (a silent wrong result)
// or corrupted the parent's streams; stopping them would tell the peers the parent left.
// So a forked child sees no runtime, and the copies are never used, stopped or destroyed.
std::atomic<bool> g_forked{false};
std::atomic<int> g_parent_pid{0};
std::atomic<int> g_global_rank{-1};
std::once_flag g_fork_handler_once;

// This process's runtimes by process set: 0 is the global one, the others run collectives
// among a subset of the ranks over transports of their own.
struct Instances : std::map<int, std::shared_ptr<Runtime>> {
  ~Instances() {
    // A forked child's exit must not destroy the parent's runtimes: that stops them, telling
    // the peers over the parent's connections that this rank shut down, and joins threads
    // this process does not have. Their references are left to the exit.
    if (!g_forked.load()) return;
    for (auto& entry : *this) new std::shared_ptr<Runtime>(std::move(entry.second));
  }
};
std::mutex g_instance_mu;
Instances g_instances;

void OnForkInChild() {  // async-signal-safe only: another thread may have held any lock
  g_forked.store(true);
  g_parent_pid.store(static_cast<int>(getppid()));
}

}  // namespace

Status ForkedChildError() {
  return Status(Code::kFailedPrecondition,
                "keras_ring: this process (pid " + std::to_string(getpid()) +
                    ") was forked from rank " + std::to_string(g_global_rank.load()) +
                    "'s process (pid " + std::to_string(g_parent_pid.load()) +
                    ") after keras_ring.init(), e.g. by a multiprocessing pool or a data "
                    "loader's workers with the 'fork' start method: keras_ring's runtime and "
                    "connections belong to that process, so collectives (and init()) run only "
                    "there. Run them in the process that called init(), or start workers with "
                    "the 'spawn' or 'forkserver' start method");
}

bool InForkedChild() { return g_forked.load(); }

Status NoRuntimeError(int process_set) {
  if (InForkedChild()) return ForkedChildError();
  if (process_set == 0) {
    return Status(Code::kFailedPrecondition,
                  "keras_ring has not been initialized; call keras_ring.init() first");
  }
  return Status(Code::kFailedPrecondition,
                "process set " + std::to_string(process_set) +
                    " is not running on this rank: this rank is not one of its ranks, or the "
                    "set was removed (keras_ring.remove_process_set) or never added");
}

std::shared_ptr<Runtime> Runtime::Get(int process_set) {
  if (InForkedChild()) return nullptr;  // before the lock: the parent may have held it
  std::lock_guard<std::mutex> lock(g_instance_mu);
  auto it = g_instances.find(process_set);
  return it == g_instances.end() ? nullptr : it->second;
}

void Runtime::Install(std::shared_ptr<Runtime> runtime, int process_set) {
  std::call_once(g_fork_handler_once, [] { pthread_atfork(nullptr, nullptr, OnForkInChild); });
  if (process_set == 0) g_global_rank.store(runtime->rank());
  std::lock_guard<std::mutex> lock(g_instance_mu);
  g_instances[process_set] = std::move(runtime);
}

std::shared_ptr<Runtime> Runtime::Uninstall(int process_set) {
  if (InForkedChild()) return nullptr;  // the parent's: left alone (see g_forked)
  std::lock_guard<std::mutex> lock(g_instance_mu);
  auto it = g_instances.find(process_set);
  if (it == g_instances.end()) return nullptr;
  std::shared_ptr<Runtime> runtime = std::move(it->second);
  g_instances.erase(it);
  return runtime;
}

std::vector<std::shared_ptr<Runtime>> Runtime::UninstallAll() {
  if (InForkedChild()) return {};
  std::lock_guard<std::mutex> lock(g_instance_mu);
  std::vector<std::shared_ptr<Runtime>> all;
  // Process sets first, the global runtime last.
  for (auto it = g_instances.rbegin(); it != g_instances.rend(); ++it) all.push_back(it->second);
  g_instances.clear();
  return all;
}

Runtime::Runtime(const RuntimeOptions& options, std::unique_ptr<Transport> transport)
    : options_(options), transport_(std::move(transport)) {
  timeline_.SetRecording(options_.timeline);
  AlgoConfig algo;
  algo.timeout_seconds = options_.timeout_seconds;
  algo.segment_bytes = options_.segment_bytes;
  algo.fast_agree = options_.fast_agree;
  algo.doubling_max_bytes = options_.doubling_max_bytes;
  host_ = std::make_unique<HostExecutor>(options_.rank, options_.size, *transport_, algo);
  worker_ = std::thread([this] { WorkerLoop(); });
  if (options_.size > 1) watchdog_ = std::thread([this] { WatchdogLoop(); });
}

Runtime::~Runtime() {
  Stop();
  if (worker_.joinable()) worker_.join();
  if (watchdog_.joinable()) watchdog_.join();
  // No collective can use it any more; its collectives still in flight complete (aborted)
  // into this runtime while it is destroyed, so it must not be reachable meanwhile.
  std::unique_ptr<Executor> device;
  {
    std::lock_guard<std::mutex> lock(device_mu_);
    device = std::move(device_);
  }
  device.reset();
}

void Runtime::Stop() { StopWith(ShutdownCause()); }

void Runtime::Abandon(const std::string& reason) {
  // kUnavailable: to its peers this is a peer lost, as if it had crashed, only explained.
  const Status cause(Code::kUnavailable,
                     "rank " + std::to_string(options_.rank) + " left with an error: " + reason,
                     options_.rank);
  StopWith(cause);
  OnFatal(cause);  // its own exit must not hang either (MPI_Finalize, teardown)
}

void Runtime::FailJob(const std::string& reason) {
  const Status cause(Code::kAborted, reason, options_.rank);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || !peer_failure_.ok()) return;  // failed or going already
    peer_failure_ = cause;
  }
  transport_->AbortWith(cause);
  {
    std::lock_guard<std::mutex> device_lock(device_mu_);
    if (device_) device_->PeerFailed(cause);
  }
  OnFatal(cause);
}

void Runtime::StopWith(const Status& requested) {
  // A clean shutdown is no failure to the peers, unless this rank leaves collectives it
  // agreed to run (the GPU lookahead's) for which they may already wait on the GPU.
  Status cause = requested;
  size_t owed = 0;
  if (requested.code() == Code::kCancelled) {
    std::lock_guard<std::mutex> lock(device_mu_);
    if (device_) owed = device_->Committed();
  }
  if (owed > 0) {
    cause = Status(Code::kAborted,
                   requested.message() + ", leaving " + std::to_string(owed) +
                       " collectives that every rank had agreed to run (their copies on the "
                       "other ranks cannot complete)",
                   options_.rank);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    stop_cause_ = cause;  // the worker, woken below, may abort the transport first
  }
  cv_.notify_all();
  watchdog_cv_.notify_all();
  // A collective still in flight at shutdown cannot complete without us; end it now
  // rather than after the timeout. Peers learn why: a clean shutdown, or a failure.
  transport_->AbortWith(cause);
  std::lock_guard<std::mutex> lock(device_mu_);
  if (device_) device_->Abort();
}

Executor* Runtime::device_executor(
    const std::function<std::unique_ptr<Executor>(HostExecutor&)>& make) {
  std::lock_guard<std::mutex> lock(device_mu_);
  if (!device_) {
    device_ = make(*host_);
    if (device_) {
      // Queued requests stay put while one executes: only the executing thread pops, and
      // a deque's push_back moves no element.
      device_->SetQueuePeek([this](const std::function<bool(const Request&)>& visit) {
        std::lock_guard<std::mutex> queue_lock(mu_);
        for (const Request& r : queue_) {
          if (!visit(r)) break;
        }
      });
    }
  }
  return device_.get();
}

void Runtime::TrackName(Request& request) {
  if (request.name.empty()) return;  // unnamed: the README's advice is a name per caller
  {
    std::lock_guard<std::mutex> lock(pending_names_->mu);
    request.concurrent = pending_names_->count[request.name]++ > 0;
  }
  request.done = [names = pending_names_, name = request.name,
                  done = std::move(request.done)](const Status& s) {
    {
      std::lock_guard<std::mutex> lock(names->mu);
      auto it = names->count.find(name);
      if (--it->second == 0) names->count.erase(it);
    }
    done(s);
  };
}

void Runtime::Submit(Request request) {
  TrackName(request);
  Enqueue(std::move(request));
}

void Runtime::Enqueue(Request request) {
  request.submitted = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      queue_.push_back(std::move(request));
      queued_.store(queue_.size());
      cv_.notify_all();
      return;
    }
  }
  // Cancelled, not FailedPrecondition: nothing diverged, the runtime is going away.
  request.done(Status(Code::kCancelled,
                      "keras_ring: the runtime is shutting down; call keras_ring.init() again"));
}

void Runtime::SubmitOrRun(Request request) {
  TrackName(request);
  bool claimed = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_ && !executing_ && queue_.empty()) {
      executing_ = true;  // the worker starts nothing until this thread is done
      claimed = true;
    }
  }
  if (!claimed) return Enqueue(std::move(request));  // the queue keeps the order
  request.submitted = Clock::now();
  bool deferred = false;
  const Status s = RunOne(request, &deferred);
  bool worker_has_work = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    executing_ = false;
    worker_has_work = stopping_ || !queue_.empty();
  }
  // Requests queued meanwhile (or a stop) are the worker's now. Otherwise it has nothing to
  // do: waking it anyway costs a futex call and a context switch per collective, which on a
  // busy host takes a core from the peers this rank waits for.
  if (worker_has_work) cv_.notify_all();
  if (!deferred) request.done(s);
}

Status Runtime::Run(Request request) {
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  Status result;
  request.done = [&](const Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    result = s;
    finished = true;
    cv.notify_all();
  };
  SubmitOrRun(std::move(request));
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return finished; });  // the worker bounds every wait, so this ends
  return result;
}

void Runtime::WorkerLoop() {
  while (true) {
    Request request;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return !executing_ && (stopping_ || !queue_.empty()); });
      if (queue_.empty()) break;  // stopping and drained
      request = std::move(queue_.front());
      queue_.pop_front();
      queued_.store(queue_.size());
      if (stopping_) {
        lock.unlock();
        request.done(Status(Code::kCancelled, "keras_ring: shut down before " +
                                                  std::string(KindName(request.kind)) +
                                                  " '" + request.name + "' ran"));
        continue;
      }
      executing_ = true;
    }
    bool deferred = false;
    const Status s = RunOne(request, &deferred);
    {
      std::lock_guard<std::mutex> lock(mu_);
      executing_ = false;
    }
    if (!deferred) request.done(s);
  }
  Status cause;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cause = stop_cause_;
  }
  if (transport_) transport_->AbortWith(cause);
}

Status Runtime::RunOne(Request& request, bool* deferred) {
  const uint64_t seq = ++seq_;
  const std::string label = SignatureOf(request, seq).Label();
  {
    std::lock_guard<std::mutex> lock(label_mu_);
    busy_label_ = label;
  }
  const Clock::time_point started = Clock::now();
  if (FollowsClosely(request, started)) request.may_yield = true;
  busy_since_ns_.store(started.time_since_epoch().count());
  busy_seq_.store(seq);
  ExecutionStats stats;
  stats.started = started;
  stats.agreed = started;
  Status s = Execute(request, seq, label, &stats);
  seq_ += stats.extra_seqs;  // a joined rank took part in that many collectives
  ran_.store(seq_);
  busy_seq_.store(0);
  last_finished_ = Clock::now();
  *deferred = stats.deferred;  // then the request was moved out: its completion records it
  if (timeline_.recording() && !stats.deferred) RecordTimeline(request, seq, started, stats, s);
  return s;
}

bool Runtime::FollowsClosely(const Request& request, Clock::time_point started) const {
  // A graph's collective waits without yielding where ranks outnumber cores: in training
  // the wait is mostly for peers still in backprop, and a yielded core goes to their
  // backprop threads, not to the peer awaited (Keras steps were slower yielding). A host
  // collective that starts right after this rank's previous one is different: it is part
  // of a chain (a graph's collectives back to back, or buckets one after another), whose
  // peers are a collective behind at most, so yielding hands the core to the peer this rank
  // waits for instead of paying a sleep and a wake-up per round. The yield stays bounded
  // (the transports' budget), then the wait sleeps as before.
  return request.placement == Placement::kHost && last_finished_ != Clock::time_point() &&
         started - last_finished_ < std::chrono::duration<double>(options_.chain_gap_seconds);
}

void Runtime::CompleteDeferred(Request& request, uint64_t seq, const ExecutionStats& stats,
                               const Status& s) {
  const Status result = s.ok() ? s : Failed(SignatureOf(request, seq).Label(), s, false);
  if (timeline_.recording()) RecordTimeline(request, seq, stats.started, stats, result);
  request.done(result);
}

Executor* Runtime::DeviceExecutor() {
  std::lock_guard<std::mutex> lock(device_mu_);
  return device_.get();
}

Status Runtime::Execute(Request& request, uint64_t seq, const std::string& label,
                        ExecutionStats* stats) {
  // Device collectives may still be in flight (completing on their own): one that runs here
  // must not overtake them, and sees their failure. The device executor orders its own.
  Executor* device = DeviceExecutor();
  const bool on_device = request.placement == Placement::kDevice;
  if (device != nullptr && !on_device) device->Drain();
  if (broken_.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    broken_ = !peer_failure_.ok() ? peer_failure_ : deferred_failure_;
  }
  if (!broken_.ok()) {
    if (device != nullptr) device->Drain();
    return broken_.InCollective(label, "keras_ring: cannot run " + label +
                                           " because an earlier collective failed: " +
                                           broken_.message());
  }
  Executor* executor = on_device ? device : host_.get();
  Status s = executor != nullptr
                 ? executor->Execute(request, seq, stats)
                 : Status(Code::kInternal, "no device executor for a device collective");
  if (s.ok()) return s;
  return Failed(label, s, true);
}

Status Runtime::Failed(const std::string& label, const Status& bare, bool executing) {
  const std::string headline =
      "keras_ring: " + label + " failed on rank " + std::to_string(options_.rank) + ": ";
  {
    // This rank is shutting down cleanly (another of its threads called shutdown) and the
    // stop cut this collective short: that is no failure of the job. Reporting it as one
    // sent peers "aborted, which gave up" where the shutdown notice had not yet reached
    // them all, and armed this process's failure exit, which then ended a program that
    // went on working after shutdown() with exit code 70.
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && stop_cause_.code() == Code::kCancelled && bare.code() == Code::kAborted &&
        bare.reporter() < 0) {
      return bare.InCollective(label, headline + bare.message());
    }
  }
  Status s = bare;
  if (executing && bare.fatal()) {
    transport_->AbortWith(bare);  // first: the blamed peer's answer may say more (AskWhy)
    s = AskWhy(bare, label);
  }
  std::string message = headline + s.message();
  if (s.code() == Code::kDeadlineExceeded) {
    message += " (KERAS_RING_TIMEOUT_SECONDS=" +
               std::to_string(static_cast<int>(options_.timeout_seconds)) + ")";
  }
  const Status failed = s.InCollective(label, message);
  if (s.fatal()) {
    // The byte streams may be out of step now: stop trusting them, and close them so every
    // peer sees this rank gone at once instead of waiting for its own timeout.
    if (executing) {
      broken_ = failed;
    } else {  // the executing thread picks it up before its next request
      std::lock_guard<std::mutex> lock(mu_);
      if (deferred_failure_.ok()) deferred_failure_ = failed;
    }
    transport_->AbortWith(bare);  // the bare cause, naming the rank to blame
    OnFatal(failed);
    std::lock_guard<std::mutex> lock(device_mu_);
    if (device_) device_->PeerFailed(s);
  }
  // A signature mismatch: every rank saw the same table and fails the same way; no data
  // moved, so the runtime stays usable.
  return failed;
}

Status Runtime::AskWhy(const Status& s, const std::string& label) {
  const int peer = s.peer();
  if (s.code() != Code::kDeadlineExceeded || s.reporter() >= 0 || peer < 0 ||
      peer == options_.rank) {
    return s;  // not this rank's own wait on a peer
  }
  // The peer answers our notice within its watchdog's period, unless it is frozen: bounded
  // by the margin that separates the depths of a wait.
  const Deadline deadline = Deadline::After(DepthMargin(options_.timeout_seconds));
  while (!deadline.expired()) {
    const Status answer = transport_->PeerNotice(peer);
    if (!answer.ok()) {
      const int blamed = answer.peer();
      if (blamed < 0 || blamed == peer || blamed == options_.rank) return s;  // no news
      const std::string why = answer.message().substr(0, answer.message().find(" (reported by"));
      const std::string waited = "rank " + std::to_string(peer) + " in " + label;
      return Status(Code::kDeadlineExceeded, "timed out waiting for " + waited + ": " + why,
                    blamed);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // polling a peer's answer
  }
  return s;
}

void Runtime::RecordTimeline(const Request& r, uint64_t seq, Clock::time_point started,
                             const ExecutionStats& stats, const Status& s) {
  TimelineEvent e;
  e.seq = seq;
  e.label = SignatureOf(r, seq).Label();
  for (const TensorRef& t : r.tensors) e.bytes += t.num_bytes();
  e.submitted_us = Timeline::NowMicros(r.submitted);
  e.started_us = Timeline::NowMicros(started);
  e.exchanged_us = Timeline::NowMicros(stats.agreed);
  e.done_us = Timeline::NowMicros();
  e.ok = s.ok();
  e.inlined = stats.inlined;
  timeline_.Record(std::move(e));
}

void Runtime::WatchdogLoop() {
  uint64_t warned = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    watchdog_cv_.wait_for(lock, std::chrono::milliseconds(250));
    if (stopping_) break;
    if (peer_failure_.ok()) {
      // A dead or failed peer is noticed here even while this rank is busy elsewhere (in
      // user code, or waiting on another peer), so the job ends instead of waiting.
      lock.unlock();
      Status failure = transport_->PollPeerFailure();
      // A peer that gave up on this rank while it still waits on others: say on whom.
      if (!failure.ok()) failure = host_->PassOnBlame(failure, BusyLabel());
      lock.lock();
      if (!failure.ok() && !stopping_) {
        peer_failure_ = failure;
        lock.unlock();
        transport_->AbortWith(failure);  // a collective in flight ends now
        {
          std::lock_guard<std::mutex> device_lock(device_mu_);
          if (device_) device_->PeerFailed(failure);  // a device wait, too
        }
        OnFatal(failure);
        lock.lock();
      }
    }
    const uint64_t seq = busy_seq_.load();
    if (options_.stall_warning_seconds <= 0 || seq == 0 || seq == warned) continue;
    const double waited =
        std::chrono::duration<double>(Clock::now().time_since_epoch() -
                                      Clock::duration(busy_since_ns_.load()))
            .count();
    if (waited < options_.stall_warning_seconds) continue;
    warned = seq;
    const std::string report = StallReport(waited);
    std::fprintf(stderr, "%s\n", report.c_str());
    std::fflush(stderr);
  }
}

Status Runtime::PeerFailure() {
  std::lock_guard<std::mutex> lock(mu_);
  return peer_failure_;
}

void Runtime::OnFatal(const Status& cause) {
  if (cause.code() == Code::kDeadlineExceeded) NoteStalledPeer();
  ArmFailureExit(options_.failure_exit_seconds, options_.rank, cause.message());
}

std::string Runtime::BusyLabel() {
  std::lock_guard<std::mutex> lock(label_mu_);
  return busy_label_;
}

std::string Runtime::StallReport(double waited_seconds) {
  const std::string label = BusyLabel();
  const int n = options_.size;
  const int r = options_.rank;
  std::string msg = "keras_ring: WARNING: rank " + std::to_string(r) + " has waited " +
                    std::to_string(static_cast<int>(waited_seconds)) + " s in " + label;
  std::vector<int> waiting_for;
  if (host_->NotYetHeardFrom(&waiting_for)) {
    // The stalled rank is among those not heard from yet in the agreement.
    std::string missing;
    for (int q : waiting_for) missing += (missing.empty() ? "" : ", ") + std::to_string(q);
    msg += ": ranks not yet heard from: " + missing +
           " (one of them has not submitted this collective, or is stalled)";
  } else {
    // The time is since the collective began, not since bytes last moved: a slow link that
    // still delivers lands here too, so the report says unfinished, not stalled.
    const int left = (r + n - 1) % n;
    const int right = (r + 1) % n;
    msg += ": every rank submitted it, and the data transfer with " +
           (left == right ? "rank " + std::to_string(left)
                          : "ranks " + std::to_string(left) + " and " + std::to_string(right)) +
           " has not finished (a slow link, or a stalled peer)";
  }
  msg += "; it fails only once a peer it waits on has been silent for "
         "KERAS_RING_TIMEOUT_SECONDS=" +
         std::to_string(static_cast<int>(options_.timeout_seconds)) + " s";
  return msg;
}

Status Runtime::ShutdownCause() {
  // Running first: a collective that ends meanwhile stores ran_ before clearing busy_seq_,
  // so the count read after an idle busy_seq_ includes it.
  const uint64_t running = busy_seq_.load();
  const uint64_t ran = ran_.load();
  std::string message = "rank " + std::to_string(options_.rank) + " shut down ";
  if (running != 0) {  // stopped mid-collective (an interrupt, say)
    message += "during its collective " + std::to_string(running) + ", " + BusyLabel();
  } else if (ran == 0) {
    message += "before any collective";
  } else {
    message += "after " + std::to_string(ran) + (ran == 1 ? " collective" : " collectives") +
               ", the last " + BusyLabel();
  }
  return Status(Code::kCancelled, message, options_.rank);
}

}  // namespace keras_ring
