#include "runtime.h"

#include "failure_exit.h"
#include "reduce.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace keras_ring {

int64_t TensorRef::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

std::mutex g_instance_mu;
std::shared_ptr<Runtime> g_instance;  // the one runtime of this process, if initialised

void CopyIfDistinct(void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes > 0) std::memcpy(dst, src, bytes);
}

}  // namespace

std::shared_ptr<Runtime> Runtime::Get() {
  std::lock_guard<std::mutex> lock(g_instance_mu);
  return g_instance;
}

void Runtime::Install(std::shared_ptr<Runtime> runtime) {
  std::lock_guard<std::mutex> lock(g_instance_mu);
  g_instance = std::move(runtime);
}

std::shared_ptr<Runtime> Runtime::Uninstall() {
  std::lock_guard<std::mutex> lock(g_instance_mu);
  return std::move(g_instance);
}

Runtime::Runtime(const RuntimeOptions& options, std::unique_ptr<Transport> transport)
    : options_(options), transport_(std::move(transport)) {
  algo_.timeout_seconds = options_.timeout_seconds;
  algo_.segment_bytes = options_.segment_bytes;
  worker_ = std::thread([this] { WorkerLoop(); });
  if (options_.size > 1) watchdog_ = std::thread([this] { WatchdogLoop(); });
}

Runtime::~Runtime() {
  Stop();
  if (worker_.joinable()) worker_.join();
  if (watchdog_.joinable()) watchdog_.join();
  backend_.reset();  // no collective can use it any more
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

void Runtime::StopWith(const Status& cause) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    stop_cause_ = cause;  // the worker, woken below, may abort the transport first
  }
  cv_.notify_all();
  // A collective still in flight at shutdown cannot complete without us; end it now
  // rather than after the timeout. Peers learn why: a clean shutdown, or a failure.
  transport_->AbortWith(cause);
  std::lock_guard<std::mutex> lock(backend_mu_);
  if (backend_) backend_->Abort();
}

DeviceBackend* Runtime::device_backend(
    const std::function<std::unique_ptr<DeviceBackend>()>& make) {
  std::lock_guard<std::mutex> lock(backend_mu_);
  if (!backend_) backend_ = make();
  return backend_.get();
}

void Runtime::Submit(Request request) {
  request.submitted = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      queue_.push_back(std::move(request));
      cv_.notify_all();
      return;
    }
  }
  request.done(Status(Code::kFailedPrecondition,
                      "keras_ring: the runtime is shutting down; call keras_ring.init() again"));
}

void Runtime::SubmitOrRun(Request request) {
  bool claimed = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_ && !executing_ && queue_.empty()) {
      executing_ = true;  // the worker starts nothing until this thread is done
      claimed = true;
    }
  }
  if (!claimed) return Submit(std::move(request));  // the queue keeps the order
  request.submitted = Clock::now();
  const Status s = RunOne(request);
  {
    std::lock_guard<std::mutex> lock(mu_);
    executing_ = false;
  }
  cv_.notify_all();  // requests queued meanwhile are the worker's now
  request.done(s);
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
      if (stopping_) {
        lock.unlock();
        request.done(Status(Code::kCancelled, "keras_ring: shut down before " +
                                                  std::string(KindName(request.kind)) +
                                                  " '" + request.name + "' ran"));
        continue;
      }
      executing_ = true;
    }
    const Status s = RunOne(request);
    {
      std::lock_guard<std::mutex> lock(mu_);
      executing_ = false;
    }
    request.done(s);
  }
  Status cause;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cause = stop_cause_;
  }
  if (transport_) transport_->AbortWith(cause);
}

Status Runtime::RunOne(Request& request) {
  const uint64_t seq = ++seq_;
  {
    std::lock_guard<std::mutex> lock(label_mu_);
    busy_label_ = MakeSignature(request, seq).Label();
  }
  exchange_steps_.store(0);
  const Clock::time_point started = Clock::now();
  busy_since_ns_.store(started.time_since_epoch().count());
  busy_seq_.store(seq);
  exchanged_at_ = started;
  inlined_ = false;
  Status s = Execute(request, seq);
  busy_seq_.store(0);
  if (options_.timeline) RecordTimeline(request, seq, started, s);
  return s;
}

void Runtime::RecordTimeline(const Request& r, uint64_t seq, Clock::time_point started,
                             const Status& s) {
  TimelineEvent e;
  e.seq = seq;
  e.label = MakeSignature(r, seq).Label();
  for (const TensorRef& t : r.tensors) e.bytes += t.num_bytes();
  e.submitted_us = Timeline::NowMicros(r.submitted);
  e.started_us = Timeline::NowMicros(started);
  e.exchanged_us = Timeline::NowMicros(exchanged_at_);
  e.done_us = Timeline::NowMicros();
  e.ok = s.ok();
  e.inlined = inlined_;
  timeline_.Record(std::move(e));
}

void Runtime::WatchdogLoop() {
  uint64_t warned = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    cv_.wait_for(lock, std::chrono::milliseconds(250));
    if (stopping_) break;
    if (peer_failure_.ok()) {
      // A dead or failed peer is noticed here even while this rank is busy elsewhere (in
      // user code, or waiting on another peer), so the job ends instead of waiting.
      lock.unlock();
      const Status failure = transport_->PollPeerFailure();
      lock.lock();
      if (!failure.ok() && !stopping_) {
        peer_failure_ = failure;
        lock.unlock();
        transport_->AbortWith(failure);  // a collective in flight ends now
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
  ArmFailureExit(options_.failure_exit_seconds, options_.rank, cause.message());
}

std::string Runtime::StallReport(double waited_seconds) {
  std::string label;
  {
    std::lock_guard<std::mutex> lock(label_mu_);
    label = busy_label_;
  }
  const int n = options_.size;
  const int r = options_.rank;
  std::string msg = "keras_ring: WARNING: rank " + std::to_string(r) + " has waited " +
                    std::to_string(static_cast<int>(waited_seconds)) + " s in " + label;
  const int steps = exchange_steps_.load();
  if (steps >= 0) {
    // After k ring steps the slots of ranks r-1 .. r-k have arrived; the stalled rank is
    // among the others.
    std::string missing;
    for (int k = steps + 1; k < n; ++k) {
      missing += (missing.empty() ? "" : ", ") + std::to_string(((r - k) % n + n) % n);
    }
    msg += ": ranks not yet heard from: " + missing +
           " (one of them has not submitted this collective, or is stalled)";
  } else {
    msg += ": every rank submitted it, the data transfer with ranks " +
           std::to_string((r + n - 1) % n) + " and " + std::to_string((r + 1) % n) +
           " is not progressing";
  }
  msg += "; it fails after KERAS_RING_TIMEOUT_SECONDS=" +
         std::to_string(static_cast<int>(options_.timeout_seconds));
  return msg;
}

Signature Runtime::MakeSignature(const Request& r, uint64_t seq) const {
  Signature s;
  s.seq = seq;
  s.kind = static_cast<int32_t>(r.kind);
  s.reduce_op = static_cast<int32_t>(r.op);
  s.root = r.root;
  s.prescale = r.prescale;
  s.postscale = r.postscale;
  s.device = r.run_on_device ? 1 : 0;
  s.SetName(r.name);
  if (r.kind == Kind::kGroupedAllreduce) {
    uint64_t h = 1469598103934665603ull;
    int64_t total = 0;
    for (const TensorRef& t : r.tensors) {
      h = HashMix(h, static_cast<uint64_t>(t.dtype));
      h = HashMix(h, static_cast<uint64_t>(t.num_elements()));
      total += t.num_elements();
    }
    s.dtype = r.tensors.empty() ? 0 : static_cast<int32_t>(r.tensors[0].dtype);
    s.ndims = static_cast<int32_t>(r.tensors.size());
    s.count = total;
    s.layout_hash = h;
    return s;
  }
  if (r.tensors.empty()) return s;  // barrier
  const TensorRef& t = r.tensors[0];
  s.dtype = static_cast<int32_t>(t.dtype);
  s.ndims = static_cast<int32_t>(t.shape.size());
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (i < kMaxSignatureDims) {
      s.dims[i] = t.shape[i];
    } else {
      h = HashMix(h, static_cast<uint64_t>(t.shape[i]));
    }
  }
  s.layout_hash = t.shape.size() > kMaxSignatureDims ? h : 0;
  if (r.kind == Kind::kAllgather) {
    s.count = t.shape.empty() ? 1 : t.shape[0];
    s.row_elems = 1;
    for (size_t i = 1; i < t.shape.size(); ++i) s.row_elems *= t.shape[i];
  } else {
    s.count = t.num_elements();
  }
  return s;
}

Status Runtime::ShutdownCause() const {
  return Status(Code::kCancelled, "rank " + std::to_string(options_.rank) + " shut down",
                options_.rank);
}

// The ring exchange stalls at the first rank that has not submitted the collective: after
// k completed steps this rank has heard from ranks r-1 .. r-k, so it waits for rank r-k-1
// (possibly through live ranks that have nothing to forward yet). Blaming that rank, not
// the neighbour, makes every waiting rank name the same stalled one.
Status Runtime::BlameForExchangeTimeout(const Request& request, uint64_t seq, int steps) const {
  const int n = options_.size;
  const int blamed = ((options_.rank - std::max(steps, 0) - 1) % n + n) % n;
  return Status(Code::kDeadlineExceeded,
                "timed out waiting for rank " + std::to_string(blamed) + " to submit " +
                    MakeSignature(request, seq).Label() +
                    " (it has not reached it, is stalled, or runs a different program)",
                blamed);
}

Status Runtime::Fail(const Request& request, uint64_t seq, const Status& cause) {
  Signature sig = MakeSignature(request, seq);
  std::string msg = "keras_ring: " + sig.Label() + " failed on rank " +
                    std::to_string(options_.rank) + ": " + cause.message();
  if (cause.code() == Code::kDeadlineExceeded) {
    msg += " (KERAS_RING_TIMEOUT_SECONDS=" + std::to_string(static_cast<int>(options_.timeout_seconds)) + ")";
  }
  return Status(cause.code(), msg, cause.peer());
}

Status Runtime::Execute(Request& request, uint64_t seq) {
  if (broken_.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    broken_ = peer_failure_;
  }
  if (!broken_.ok()) {
    return Status(broken_.code(), "keras_ring: cannot run " + MakeSignature(request, seq).Label() +
                                      " because an earlier collective failed: " +
                                      broken_.message(),
                  broken_.peer());
  }
  slots_.resize(static_cast<size_t>(options_.size));
  Slot& mine = slots_[static_cast<size_t>(options_.rank)];
  mine.sig = MakeSignature(request, seq);
  mine.sig.inlined = PackInline(request, &mine) ? 1 : 0;
  Status s = ExchangeSlots(*transport_, options_.timeout_seconds, &slots_, &exchange_steps_);
  const int steps = exchange_steps_.exchange(-1);
  if (s.code() == Code::kDeadlineExceeded && s.message().rfind("timed out waiting", 0) == 0) {
    s = BlameForExchangeTimeout(request, seq, steps);  // our own wait, not a relayed notice
  }
  exchanged_at_ = Clock::now();
  if (s.ok()) {
    std::vector<Signature> sigs;
    bool all_inlined = true;
    for (const Slot& slot : slots_) {
      sigs.push_back(slot.sig);
      all_inlined = all_inlined && slot.sig.inlined != 0;
    }
    s = CheckSignatures(sigs);
    if (!s.ok()) {
      // Every rank saw the same table and fails the same way; no data moved, so the
      // runtime stays usable.
      return Status(s.code(), "keras_ring: " + s.message(), s.peer());
    }
    inlined_ = all_inlined;
    if (request.run_on_device) {
      s = request.run_on_device(*transport_, sigs);
    } else if (all_inlined) {
      s = ExecuteInline(request, sigs);
    } else {
      switch (request.kind) {
        case Kind::kAllreduce: s = ExecuteAllreduce(request); break;
        case Kind::kGroupedAllreduce: s = ExecuteGrouped(request); break;
        case Kind::kAllgather: s = ExecuteAllgather(request, sigs); break;
        case Kind::kBroadcast: s = ExecuteBroadcast(request); break;
        case Kind::kBarrier: break;
      }
    }
  }
  if (s.ok()) return s;
  Status failed = Fail(request, seq, s);
  if (s.fatal()) {
    // The byte streams may be out of step now: stop trusting them, and close them so every
    // peer sees this rank gone at once instead of waiting for its own timeout.
    broken_ = failed;
    transport_->AbortWith(s);  // the bare cause, naming the rank to blame
    OnFatal(failed);
    std::lock_guard<std::mutex> lock(backend_mu_);
    if (backend_) backend_->PeerFailed();
  }
  return failed;
}

bool Runtime::PackInline(const Request& r, Slot* slot) const {
  if (r.run_on_device) return false;  // pointers into device memory
  size_t bytes = 0;
  for (const TensorRef& t : r.tensors) bytes += t.num_bytes();
  if (bytes > kInlineCapacity) return false;
  if (r.kind == Kind::kBroadcast && options_.rank != r.root) return true;  // receives only
  size_t off = 0;
  for (const TensorRef& t : r.tensors) {
    if (t.num_bytes() > 0) std::memcpy(slot->payload + off, t.input, t.num_bytes());
    off += t.num_bytes();
  }
  return true;
}

// Every rank combines the ranks' contributions in rank order, so all get the same bits.
void Runtime::ReduceInline(const Request& r, DataType dtype, size_t offset, size_t count,
                           void* out) {
  const size_t bytes = count * DataTypeSize(dtype);
  if (bytes == 0) return;
  std::memcpy(out, slots_[0].payload + offset, bytes);
  Scale(dtype, out, count, r.prescale);
  for (size_t rank = 1; rank < slots_.size(); ++rank) {
    const void* peer = slots_[rank].payload + offset;
    if (r.prescale != 1.0) {
      scratch_.resize(bytes);
      std::memcpy(scratch_.data(), peer, bytes);
      Scale(dtype, scratch_.data(), count, r.prescale);
      peer = scratch_.data();
    }
    Reduce(dtype, r.op, out, peer, count);
  }
  if (r.op == ReduceOp::kAverage) {
    AverageScale(dtype, out, count, options_.size, r.postscale);
  } else {
    Scale(dtype, out, count, r.postscale);
  }
}

Status Runtime::ExecuteInline(Request& r, const std::vector<Signature>& sigs) {
  switch (r.kind) {
    case Kind::kAllreduce:
    case Kind::kGroupedAllreduce: {
      size_t offset = 0;
      for (TensorRef& t : r.tensors) {
        ReduceInline(r, t.dtype, offset, static_cast<size_t>(t.num_elements()), t.output);
        offset += t.num_bytes();
      }
      return Status::OK();
    }
    case Kind::kAllgather: {
      TensorRef& t = r.tensors[0];
      int64_t rows = 0;
      for (const Signature& s : sigs) rows += s.count;
      void* out = nullptr;
      KR_RETURN_IF_ERROR(r.allocate_output(rows, &out));  // nothing is in flight: not fatal
      char* dst = static_cast<char*>(out);
      for (size_t rank = 0; rank < sigs.size(); ++rank) {
        const size_t bytes =
            static_cast<size_t>(sigs[rank].count * sigs[rank].row_elems) * DataTypeSize(t.dtype);
        if (bytes > 0) std::memcpy(dst, slots_[rank].payload, bytes);
        dst += bytes;
      }
      return Status::OK();
    }
    case Kind::kBroadcast: {
      TensorRef& t = r.tensors[0];
      if (t.num_bytes() > 0) {
        std::memcpy(t.output, slots_[static_cast<size_t>(r.root)].payload, t.num_bytes());
      }
      return Status::OK();
    }
    case Kind::kBarrier:
      return Status::OK();
  }
  return Status::OK();
}

Status Runtime::ExecuteAllreduce(Request& r) {
  TensorRef& t = r.tensors[0];
  return RingAllreduce(*transport_, algo_, t.dtype, r.op, t.input, t.output,
                       static_cast<size_t>(t.num_elements()), r.prescale, r.postscale);
}

Status Runtime::ExecuteGrouped(Request& r) {
  // One ring pass per dtype, dtypes in order of first appearance, over the tensors where
  // they lie (no fusion buffer: the ring cuts its segments at the tensors' boundaries).
  std::vector<DataType> order;
  for (const TensorRef& t : r.tensors) {
    if (std::find(order.begin(), order.end(), t.dtype) == order.end()) order.push_back(t.dtype);
  }
  for (DataType dtype : order) {
    std::vector<Part> parts;
    for (TensorRef& t : r.tensors) {
      if (t.dtype == dtype) {
        parts.push_back(Part{t.input, t.output, static_cast<size_t>(t.num_elements())});
      }
    }
    KR_RETURN_IF_ERROR(RingAllreduce(*transport_, algo_, dtype, r.op, std::move(parts),
                                     r.prescale, r.postscale));
  }
  return Status::OK();
}

Status Runtime::ExecuteAllgather(Request& r, const std::vector<Signature>& sigs) {
  TensorRef& t = r.tensors[0];
  const size_t esize = DataTypeSize(t.dtype);
  int64_t total_rows = 0;
  std::vector<size_t> block_bytes;
  for (const Signature& s : sigs) {
    total_rows += s.count;
    block_bytes.push_back(static_cast<size_t>(s.count * s.row_elems) * esize);
  }
  void* out = nullptr;
  Status alloc = r.allocate_output(total_rows, &out);
  if (!alloc.ok()) {
    // Peers are about to exchange data with us; failing alone would leave them waiting.
    return Status(Code::kAborted, "could not allocate the allgather output: " + alloc.message());
  }
  size_t offset = 0;
  for (int i = 0; i < options_.rank; ++i) offset += block_bytes[static_cast<size_t>(i)];
  CopyIfDistinct(static_cast<char*>(out) + offset, t.input, t.num_bytes());
  return RingAllgatherv(*transport_, algo_, out, block_bytes);
}

Status Runtime::ExecuteBroadcast(Request& r) {
  TensorRef& t = r.tensors[0];
  if (options_.rank == r.root) CopyIfDistinct(t.output, t.input, t.num_bytes());
  return ChainBroadcast(*transport_, algo_, t.output, t.num_bytes(), r.root);
}

}  // namespace keras_ring
