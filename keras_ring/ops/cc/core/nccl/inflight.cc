// Collectives in flight on the GPU: the depth limit, the hand-over from the worker, and the
// completion thread that polls them in order (see backend.h).
//
// The completion thread owns the oldest collective in flight: it polls that one's event
// until it is reached, then completes it through the runtime (its done runs there) and moves
// on; the collectives behind it are queued on the same stream, so none can finish first. Each
// poll also asks ncclCommGetAsyncError (when the worker is not using the communicator at
// that moment) and the stop conditions: the deadline of that collective's launch, shutdown, a
// signal, a failed peer (the host transport is looked at every 10 ms), so this wait is as
// bounded as the worker's was. On a failure the communicators are aborted (which ends the
// kernels, so every event behind it is reached too) and the collective fails with the
// cause, every one behind it with "in flight behind ... which failed", and the worker's next
// launch (or its launch under way, through its own stop check) with the same cause. Failures
// on the GPU are fatal, so the runtime is broken from then on on this rank, and its peers
// learn it through the host transport's abort.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "backend.h"

namespace keras_ring {
namespace nccl {

namespace {
// How often the worker looks at a lone collective's event before handing it over: about as
// long as PollBackoff yields before it starts to sleep.
constexpr int kInlinePolls = 100;
}  // namespace

bool NcclBackend::OnCompletionThread() const {
  return std::this_thread::get_id() == completer_.get_id();
}

int NcclBackend::max_in_flight_seen() {
  std::lock_guard<std::mutex> lock(flight_mu_);
  return static_cast<int>(max_seen_);
}

Status NcclBackend::GpuFailure() {
  if (!gpu_failed_.load()) return Status::OK();
  std::lock_guard<std::mutex> lock(failure_mu_);
  return Status(gpu_failure_.code(), "an earlier NCCL collective failed: " + gpu_failure_.message(),
                gpu_failure_.peer());
}

Status NcclBackend::WaitForSlot(const StopCheck& stop) {
  // A done callback that submits and runs a device collective on this very thread must not
  // wait for itself: it exceeds the limit by one instead.
  if (OnCompletionThread()) return Status::OK();
  std::unique_lock<std::mutex> lock(flight_mu_);
  while (in_flight_.size() >= max_in_flight_) {
    // The oldest one completes or fails by its deadline, which is earlier than this one's.
    lock.unlock();
    KR_RETURN_IF_ERROR(stop("a slot for a collective on the GPU"));
    lock.lock();
    flight_cv_.wait_for(lock, std::chrono::milliseconds(10),
                        [this] { return in_flight_.size() < max_in_flight_; });
  }
  return Status::OK();
}

void NcclBackend::Defer(InFlight entry) {
  // With nothing else in flight and no request waiting for the worker, a short look first (as
  // the worker always did before): a small collective is often complete by then, and
  // completing it here spares the hand-over to the completion thread, a wake-up on each side,
  // which is much of a lone collective's host cost. The look ends as soon as a request
  // arrives, so a burst still piles up in flight. Only "reached" is taken here; anything else
  // is the completion thread's to judge.
  bool alone = false;
  if (!OnCompletionThread()) {
    std::lock_guard<std::mutex> lock(flight_mu_);
    alone = in_flight_.empty();  // only the executing thread adds: it stays empty meanwhile
  }
  for (int polls = 0; alone && polls < kInlinePolls && !work_waiting_(); ++polls) {
    if (api_->EventQuery(entry.done) == kCudaSuccess) {
      {
        std::lock_guard<std::mutex> lock(flight_mu_);
        max_seen_ = std::max<size_t>(max_seen_, 1);
      }
      Finish(entry, Status::OK());  // no lock held: its done may run anything
      return;
    }
    std::this_thread::yield();
  }
  {
    std::lock_guard<std::mutex> lock(flight_mu_);
    in_flight_.push_back(std::move(entry));
    max_seen_ = std::max(max_seen_, in_flight_.size());
  }
  flight_cv_.notify_all();
}

void NcclBackend::Drain() {
  if (OnCompletionThread()) return;  // see WaitForSlot
  std::unique_lock<std::mutex> lock(flight_mu_);
  // Bounded: the completion thread ends each one by its deadline.
  flight_cv_.wait(lock, [this] { return in_flight_.empty(); });
}

void NcclBackend::CompletionLoop() {
  int current_device = -1;  // this thread has no CUDA context until it polls an event
  std::unique_lock<std::mutex> lock(flight_mu_);
  while (true) {
    flight_cv_.wait(lock, [this] { return stopping_ || !in_flight_.empty(); });
    if (in_flight_.empty()) return;  // stopping, and everything completed
    // Only this thread pops, and a deque's push_back keeps references to its elements.
    InFlight& front = in_flight_.front();
    lock.unlock();
    const Status s = Poll(front, &current_device);
    const std::string label = SignatureOf(front.request, front.seq).Label();
    Finish(front, s);
    size_t finished = 1;
    if (!s.ok()) {
      // Everything behind it on the stream ran on aborted communicators.
      lock.lock();
      const size_t behind = in_flight_.size() - 1;
      lock.unlock();
      const std::string cause = "it was in flight on the GPU behind " + label + " (#" +
                                std::to_string(front.seq) + "), which failed: " + s.message();
      for (size_t i = 1; i <= behind; ++i) {
        lock.lock();
        InFlight& next = in_flight_[i];
        lock.unlock();
        Finish(next, Status(s.code(), cause, s.peer()));
      }
      finished += behind;
    }
    lock.lock();
    for (size_t i = 0; i < finished; ++i) in_flight_.pop_front();
    flight_cv_.notify_all();  // a slot for the worker, or a drain that ends
  }
}

Status NcclBackend::Poll(InFlight& f, int* current_device) {
  if (*current_device != f.device) {
    // Without a current device this thread's first CUDA call would make a context on GPU 0.
    const int r = api_->SetDevice(f.device);
    if (r != kCudaSuccess) return FailInFlight(Cuda(r, "cudaSetDevice"));
    *current_device = f.device;
  }
  Clock::time_point next_liveness_poll{};
  for (int polls = 0;; ++polls) {
    const int q = api_->EventQuery(f.done);
    if (q == kCudaSuccess) return Status::OK();
    Status s = q == kCudaErrorNotReady ? Status::OK() : Cuda(q, "cudaEventQuery");
    if (s.ok()) s = StopReason(f.deadline, f.what, &next_liveness_poll);
    if (s.ok()) {
      // Skipped while the worker launches on it: its own polls report such an error.
      std::unique_lock<std::mutex> comm_lock(comm_mu_, std::try_to_lock);
      if (comm_lock.owns_lock()) {
        std::lock_guard<std::mutex> lock(mu_);
        DeviceState& d = devices_[f.device];
        if (d.comm && !d.comm->aborted()) s = d.comm->AsyncError(f.what);
      }
    }
    if (!s.ok()) return FailInFlight(s);
    PollBackoff(polls);
  }
}

Status NcclBackend::FailInFlight(const Status& cause) {
  {
    // First, so that the worker's launch under way stops and lets go of the communicator.
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (!gpu_failed_.load()) gpu_failure_ = cause;
    gpu_failed_.store(true);
  }
  std::lock_guard<std::mutex> comm_lock(comm_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& entry : devices_) {
    if (entry.second.comm) entry.second.comm->Abort();  // idempotent
  }
  return Status(cause.code(), cause.message() + " (its NCCL communicator was aborted)",
                cause.peer());
}

void NcclBackend::Finish(InFlight& f, const Status& s) {
  if (f.done != nullptr) ReleaseEvent(f.device, f.done);
  if (f.allocated != nullptr) ReleaseEvent(f.device, f.allocated);
  f.done = f.allocated = nullptr;
  complete_(f.request, f.seq, f.stats, s);
  f.request = Request();  // its ticket returns its event now, not at the pop
}

}  // namespace nccl
}  // namespace keras_ring
