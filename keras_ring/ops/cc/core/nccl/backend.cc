#include "backend.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "../algorithms.h"

namespace keras_ring {
namespace nccl {

namespace {

// What each rank tells the others before a communicator is made.
struct Readiness {
  int32_t ok = 0;
  char reason[508] = {};
};

// Rank 0's ncclUniqueId, or why it has none.
struct IdMessage {
  int32_t ok = 0;
  UniqueId id = {};
  char reason[380] = {};
};

void CopyReason(const std::string& text, char* out, size_t cap) {
  // The loader's messages start with "keras_ring: "; the runtime adds its own prefix.
  const std::string prefix = "keras_ring: ";
  const size_t skip = text.compare(0, prefix.size(), prefix) == 0 ? prefix.size() : 0;
  const size_t n = std::min(text.size() - skip, cap - 1);
  std::memcpy(out, text.data() + skip, n);
  out[n] = '\0';
}

// Makes `device` current on this thread for the guard's life. The device the thread was on
// is put back only where the thread had a context: on a thread without one cudaGetDevice
// says 0, and switching "back" would create a context on GPU 0 (CUDA 12 makes the primary
// context in cudaSetDevice) in every process, whatever its own GPU (the rule PyTorch's
// MaybeSetDevice follows).
class DeviceGuard {
 public:
  DeviceGuard(DeviceApi& api, int device) : api_(api) {
    bool has_context = false;
    int current = -1;
    if (api.HasCurrentContext(&has_context) == kCudaSuccess && has_context &&
        api.GetDevice(&current) == kCudaSuccess && current != device) {
      previous_ = current;
    }
    result_ = api.SetDevice(device);
  }
  ~DeviceGuard() {
    if (previous_ >= 0) api_.SetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  int result() const { return result_; }

 private:
  DeviceApi& api_;
  int previous_ = -1;
  int result_ = kCudaSuccess;
};

int64_t TotalRows(const std::vector<Signature>& sigs) {
  int64_t rows = 0;
  for (const Signature& s : sigs) rows += s.count;
  return rows;
}

// Decided from the signatures (every rank's), so every rank skips NCCL alike: an alltoall
// rank that sends and receives nothing still has peers exchanging among themselves.
bool NothingToMove(const std::vector<Signature>& sigs, const Request& c) {
  if (c.kind == Kind::kAllgather) {
    return PlanGather(sigs, DataTypeSize(c.tensors[0].dtype)).total == 0;
  }
  if (c.kind == Kind::kAlltoall) return TotalRows(sigs) * sigs[0].row_elems == 0;
  for (const TensorRef& t : c.tensors) {
    if (t.num_bytes() > 0) return false;
  }
  return true;
}

// Allgather and alltoall allocate their output once the rows are known.
bool AllocatesOutput(Kind kind) { return kind == Kind::kAllgather || kind == Kind::kAlltoall; }

std::string Seconds(double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", s);  // what `ostream << s` prints, without a locale
  return text;
}

}  // namespace

StreamTicket::~StreamTicket() {
  if (ready != nullptr) owner->ReleaseEvent(device, ready);
}

NcclBackend::NcclBackend(std::shared_ptr<DeviceApi> api, HostExecutor& host, int rank,
                         int size, double timeout_seconds, int max_in_flight,
                         Completion complete, WorkWaiting work_waiting)
    : api_(std::move(api)), host_(host), rank_(rank), size_(size),
      timeout_seconds_(timeout_seconds),
      max_in_flight_(static_cast<size_t>(std::max(max_in_flight, 1))),
      complete_(std::move(complete)), work_waiting_(std::move(work_waiting)) {
  completer_ = std::thread([this] { CompletionLoop(); });
}

NcclBackend::~NcclBackend() {
  {
    std::lock_guard<std::mutex> lock(flight_mu_);
    stopping_ = true;  // the loop ends once what is in flight completed
  }
  flight_cv_.notify_all();
  if (completer_.joinable()) completer_.join();
  ReleaseCommunicators();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& entry : devices_) {
    DeviceState& d = entry.second;
    DeviceGuard on_device(*api_, entry.first);
    for (Event e : d.free_events) api_->EventDestroy(e);
    if (d.stream != nullptr) api_->StreamDestroy(d.stream);
  }
}

void NcclBackend::ReleaseCommunicators() {
  // Every collective completed or was aborted, but the peers may still be receiving: a
  // cooperative end flushes that, bounded by the deadline (then aborted). After a failure a
  // peer may be gone for good, so abort at once.
  std::vector<std::pair<int, std::unique_ptr<Communicator>>> comms;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& entry : devices_) {
      if (entry.second.comm) comms.emplace_back(entry.first, std::move(entry.second.comm));
    }
  }
  const double limit = std::min(timeout_seconds_, 60.0);
  const Deadline deadline = Deadline::After(limit);
  for (auto& entry : comms) {
    if (entry.second->aborted()) continue;  // a failed collective ended it already
    DeviceGuard on_device(*api_, entry.first);
    if (peer_failed_.load()) {
      entry.second->Abort();
    } else if (!entry.second->Close(deadline)) {
      std::fprintf(stderr,
                   "keras_ring: WARNING: the NCCL communicator on GPU %d could not be finalized "
                   "within %s s (a peer may have exited without keras_ring.shutdown()); it was "
                   "aborted\n",
                   entry.first, Seconds(limit).c_str());
    }
    entry.second.reset();
  }
}

void NcclBackend::Abort() { aborted_.store(true); }

void NcclBackend::PeerFailed(const Status& cause) {
  std::lock_guard<std::mutex> lock(failure_mu_);
  if (peer_failure_.ok()) {
    peer_failure_ = cause.ok() ? Status(Code::kUnavailable, "the host data plane failed") : cause;
  }
  peer_failed_.store(true);
}

int NcclBackend::communicator_count() {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (const auto& entry : devices_) n += entry.second.comm ? 1 : 0;
  return n;
}

NcclBackend::DeviceState& NcclBackend::State(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  return devices_[device];
}

DeviceComm NcclBackend::CommunicatorFor(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceComm use;
  use.device = device;
  auto it = devices_.find(device);
  if (it != devices_.end() && it->second.comm) {
    use.ordinal = it->second.ordinal;
  } else {
    use.ordinal = communicators_made_;
    use.creates = true;
  }
  return use;
}

Status NcclBackend::Cuda(int error, const char* call) {
  return error == kCudaSuccess ? Status::OK()
                               : CudaError(error, call, api_->CudaErrorString(error));
}

Status NcclBackend::Nccl(int result, const char* call) {
  return result == kNcclSuccess ? Status::OK()
                                : NcclError(result, call, api_->NcclErrorString(result));
}

Status NcclBackend::TakeEvent(int device, Event* event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Event>& pool = devices_[device].free_events;
    if (!pool.empty()) {
      *event = pool.back();
      pool.pop_back();
      return Status::OK();
    }
  }
  events_made_.fetch_add(1);
  return Cuda(api_->EventCreate(event), "cudaEventCreateWithFlags");  // on the current device
}

void NcclBackend::ReleaseEvent(int device, Event event) {
  std::lock_guard<std::mutex> lock(mu_);
  devices_[device].free_events.push_back(event);
}

std::shared_ptr<StreamTicket> NcclBackend::Prepare(int device, Stream caller_stream) {
  auto ticket = std::make_shared<StreamTicket>(this, device, caller_stream);
  ticket->status = api_->LoadCuda();
  if (!ticket->status.ok()) return ticket;
  // The caller's thread (TensorFlow's) may be working on another device: leave it as it was.
  DeviceGuard on_device(*api_, device);
  Status s = Cuda(on_device.result(), "cudaSetDevice");
  Event ready = nullptr;
  if (s.ok()) s = TakeEvent(device, &ready);
  if (s.ok()) {
    ticket->ready = ready;
    s = Cuda(api_->EventRecord(ready, caller_stream), "cudaEventRecord");
  }
  ticket->status = s;
  return ticket;
}

Status NcclBackend::Execute(Request& request, uint64_t seq, ExecutionStats* stats) {
  auto* ticket = dynamic_cast<StreamTicket*>(request.device_ticket.get());
  if (ticket == nullptr) {
    Drain();
    return Status(Code::kInternal, "a device collective without NCCL's ticket reached NCCL");
  }
  // Which communicator this rank would use is agreed like the shape.
  request.device_comm = CommunicatorFor(ticket->device);
  std::vector<Signature> sigs;
  Status s = AgreeAhead(request, seq, &sigs);
  if (s.ok()) {
    stats->agreed = Clock::now();
    s = Run(host_.transport(), sigs, request, *ticket, seq, stats);
  }
  // Completed here rather than in flight: after those in flight, in submission order.
  if (!stats->deferred) Drain();
  return s;
}

Status NcclBackend::Run(Transport& control, const std::vector<Signature>& sigs, Request& c,
                        StreamTicket& ticket, uint64_t seq, ExecutionStats* stats) {
  // Everything decided before the first NCCL call depends only on the agreed signatures, so
  // every rank takes the same branch and a refusal is an ordinary, non-fatal error.
  LaunchPlan plan;
  KR_RETURN_IF_ERROR(Plan(sigs, c, &plan));
  if (c.kind == Kind::kBarrier) return Status::OK();
  if (NothingToMove(sigs, c)) {
    if (!AllocatesOutput(c.kind)) return Status::OK();
    const int64_t rows = c.kind == Kind::kAllgather ? TotalRows(sigs) : plan.exchange.total_rows;
    return c.allocate_output(rows, &c.tensors[0].output);
  }
  KR_RETURN_IF_ERROR(Ready(control, ticket));
  return RunOnStream(sigs, c, plan, ticket, State(ticket.device), seq, stats);
}

Status NcclBackend::Plan(const std::vector<Signature>& sigs, Request& c, LaunchPlan* plan) {
  if (c.kind == Kind::kAllreduce || c.kind == Kind::kGroupedAllreduce ||
      c.kind == Kind::kReducescatter) {
    const char* what = c.kind == Kind::kReducescatter ? "reducescatter" : "allreduce";
    for (const TensorRef& t : c.tensors) {
      plan->reduce.emplace_back();
      KR_RETURN_IF_ERROR(
          PlanReduce(t.dtype, c.op, c.prescale, c.postscale, size_, &plan->reduce.back(), what));
    }
  }
  if (c.kind == Kind::kAlltoall) {
    // The splits came with the signatures; a bad one fails every rank alike, here.
    std::vector<std::vector<int64_t>> splits;
    KR_RETURN_IF_ERROR(host_.AlltoallSplits(sigs, &splits));
    const size_t row_bytes =
        static_cast<size_t>(sigs[0].row_elems) * DataTypeSize(c.tensors[0].dtype);
    plan->exchange = PlanExchange(splits, rank_, row_bytes);
    if (c.received_splits != nullptr) {
      std::copy(plan->exchange.recv_rows.begin(), plan->exchange.recv_rows.end(),
                c.received_splits);
    }
  }
  return Status::OK();
}

Status NcclBackend::Ready(Transport& control, StreamTicket& ticket) {
  Status local = ticket.status;
  if (local.ok()) local = api_->LoadNccl();
  if (local.ok()) local = Cuda(api_->SetDevice(ticket.device), "cudaSetDevice");
  DeviceState& d = State(ticket.device);
  if (!d.comm) {
    if (local.ok() && d.stream == nullptr) {
      local = Cuda(api_->StreamCreate(&d.stream), "cudaStreamCreateWithFlags");
    }
    return Connect(control, ticket.device, local);
  }
  if (local.ok()) return Status::OK();
  // The peers are about to run this collective with us: failing alone would leave them
  // waiting, so break the communicator (they see the abort or time out).
  std::lock_guard<std::mutex> lock(comm_mu_);
  d.comm->Abort();
  return Status(Code::kAborted, local.message());
}

Status NcclBackend::RunOnStream(const std::vector<Signature>& sigs, Request& c,
                                const LaunchPlan& plan, StreamTicket& ticket, DeviceState& d,
                                uint64_t seq, ExecutionStats* stats) {
  const Deadline deadline = Deadline::After(timeout_seconds_);
  const StopCheck stop = StopAt(deadline);
  Status s = WaitForSlot(stop);
  Event allocated = nullptr;
  Event done = nullptr;
  {
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (s.ok()) s = GpuFailure();  // one in flight failed (and aborted the communicators)
    if (s.ok()) s = LaunchOnStream(sigs, c, plan, ticket, d, stop, &allocated, &done);
    if (!s.ok() && !d.comm->aborted()) {
      d.comm->Abort();  // the peers may be inside the collective already
      s = Status(s.code(), s.message() + " (its NCCL communicator was aborted)", s.peer());
    }
  }
  if (!s.ok()) {
    if (done != nullptr) ReleaseEvent(ticket.device, done);
    if (allocated != nullptr) ReleaseEvent(ticket.device, allocated);
    return s;
  }
  InFlight f;
  f.seq = seq;
  f.stats = *stats;
  f.device = ticket.device;
  f.done = done;
  f.allocated = allocated;
  f.deadline = deadline;
  f.what = std::string("NCCL ") + KindName(c.kind);
  f.request = std::move(c);  // the runtime's copy is left empty: it completes from here
  stats->deferred = true;
  Defer(std::move(f));
  return Status::OK();
}

Status NcclBackend::LaunchOnStream(const std::vector<Signature>& sigs, Request& c,
                                   const LaunchPlan& plan, StreamTicket& ticket, DeviceState& d,
                                   const StopCheck& stop, Event* allocated, Event* done) {
  Event ready = ticket.ready;
  if (AllocatesOutput(c.kind)) {
    const int64_t rows = c.kind == Kind::kAllgather ? TotalRows(sigs) : plan.exchange.total_rows;
    const Status s = c.allocate_output(rows, &c.tensors[0].output);
    if (!s.ok()) {
      return Status(Code::kAborted, std::string("could not allocate the ") + KindName(c.kind) +
                                        " output: " + s.message());
    }
    // The new output may reuse memory that work queued on the caller's stream after the
    // submission still reads: start after everything queued there so far.
    KR_RETURN_IF_ERROR(TakeEvent(ticket.device, allocated));
    KR_RETURN_IF_ERROR(
        Cuda(api_->EventRecord(*allocated, ticket.caller_stream), "cudaEventRecord"));
    ready = *allocated;
  }
  KR_RETURN_IF_ERROR(Cuda(api_->StreamWaitEvent(d.stream, ready), "cudaStreamWaitEvent"));
  // A nonblocking launch is settled before anything else is queued on the stream.
  KR_RETURN_IF_ERROR(Launch(sigs, c, plan, *d.comm, d.stream, stop));
  KR_RETURN_IF_ERROR(TakeEvent(ticket.device, done));
  KR_RETURN_IF_ERROR(Cuda(api_->EventRecord(*done, d.stream), "cudaEventRecord"));
  // TensorFlow's stream reads the result after this point; the op's done() comes later still,
  // once the completion thread saw the event reached.
  return Cuda(api_->StreamWaitEvent(ticket.caller_stream, *done), "cudaStreamWaitEvent");
}

Status NcclBackend::Connect(Transport& control, int device, const Status& local) {
  AlgoConfig cfg;
  cfg.timeout_seconds = timeout_seconds_;
  std::vector<Readiness> all(static_cast<size_t>(size_));
  Readiness& mine = all[static_cast<size_t>(rank_)];
  mine.ok = local.ok() ? 1 : 0;
  if (!local.ok()) CopyReason(local.message(), mine.reason, sizeof mine.reason);
  KR_RETURN_IF_ERROR(RingAllgatherv(control, cfg, all.data(),
                                    std::vector<size_t>(all.size(), sizeof(Readiness))));
  std::vector<int> failed;
  for (int r = 0; r < size_; ++r) {
    if (!all[static_cast<size_t>(r)].ok) failed.push_back(r);
  }
  if (!failed.empty()) {
    std::string msg = "rank " + std::to_string(failed[0]) + ": " +
                      all[static_cast<size_t>(failed[0])].reason;
    if (failed.size() > 1) {
      msg += " (ranks that cannot run NCCL:";
      for (int r : failed) msg += " " + std::to_string(r);
      msg += ")";
    }
    return Status(Code::kFailedPrecondition, msg, failed[0]);
  }
  IdMessage id;
  if (rank_ == 0) {
    const int r = api_->GetUniqueId(&id.id);
    id.ok = r == kNcclSuccess ? 1 : 0;
    if (!id.ok) CopyReason(Nccl(r, "ncclGetUniqueId").message(), id.reason, sizeof id.reason);
  }
  KR_RETURN_IF_ERROR(ChainBroadcast(control, cfg, &id, sizeof id, 0));
  if (!id.ok) {
    return Status(Code::kFailedPrecondition,
                  std::string("rank 0 could not make an NCCL unique id: ") + id.reason, 0);
  }
  std::unique_ptr<Communicator> comm;
  KR_RETURN_IF_ERROR(Communicator::Create(*api_, size_, id.id, rank_,
                                          StopAt(Deadline::After(timeout_seconds_)), &comm));
  std::lock_guard<std::mutex> lock(mu_);  // the completion thread may look for it to abort
  DeviceState& d = devices_[device];
  d.comm = std::move(comm);
  d.ordinal = communicators_made_++;
  return Status::OK();
}

StopCheck NcclBackend::StopAt(const Deadline& deadline) {
  return [this, deadline](const std::string& what) {
    return StopReason(deadline, what, &next_liveness_poll_);
  };
}

Status NcclBackend::StopReason(const Deadline& deadline, const std::string& what,
                               Clock::time_point* next_liveness_poll) {
  if (aborted_.load()) {
    return Status(Code::kAborted, "keras_ring shut down while " + what + " was running");
  }
  KR_RETURN_IF_ERROR(InterruptStatus());
  KR_RETURN_IF_ERROR(PeerFailure(next_liveness_poll));
  KR_RETURN_IF_ERROR(GpuFailure());
  if (deadline.expired()) {
    return Status(Code::kDeadlineExceeded,
                  what + " did not complete within " + Seconds(timeout_seconds_) +
                      " s; a peer may have stalled or died");
  }
  return Status::OK();
}

Status NcclBackend::PeerFailure(Clock::time_point* next_poll) {
  if (peer_failed_.load()) {
    std::lock_guard<std::mutex> lock(failure_mu_);
    return peer_failure_;
  }
  // NCCL's transports within a host may never report a peer that died: its kernels wait
  // for data that never comes. The host transport's control sockets do (an EOF, or the
  // peer's abort notice). The watchdog looks every 250 ms and calls PeerFailed; between its
  // visits the worker looks too, every 10 ms (a poll with no timeout, nothing consumed).
  const Clock::time_point now = Clock::now();
  if (now < *next_poll) return Status::OK();
  *next_poll = now + std::chrono::milliseconds(10);
  return host_.transport().PollPeerFailure();
}

Status NcclBackend::Launch(const std::vector<Signature>& sigs, Request& c,
                           const LaunchPlan& plan, Communicator& comm, Stream stream,
                           const StopCheck& stop) {
  switch (c.kind) {
    case Kind::kAllreduce:
    case Kind::kGroupedAllreduce:
      return LaunchReduce(c, plan.reduce, comm, stream, stop);
    case Kind::kReducescatter:
      return LaunchReducescatter(c, plan.reduce[0], comm, stream, stop);
    case Kind::kAlltoall:
      return LaunchAlltoall(c, plan.exchange, comm, stream, stop);
    case Kind::kAllgather:
      return LaunchAllgather(sigs, c, comm, stream, stop);
    case Kind::kBroadcast: {
      // Raw bytes: any dtype (bool included) broadcasts alike.
      const TensorRef& t = c.tensors[0];
      return comm.Settle(api_->Broadcast(t.input, t.output, t.num_bytes(), kNcclInt8, c.root,
                                         comm.get(), stream),
                         "ncclBroadcast", stop);
    }
    case Kind::kBarrier:
      break;
    case Kind::kJoin:  // a host request (the C API's), never placed on a device
      return Status(Code::kInvalidArgument, "join has no NCCL implementation");
  }
  return Status::OK();
}

// Inside a group NCCL only records the call (a nonblocking communicator may say
// ncclInProgress already); ncclGroupEnd launches, and that result is the one to settle.
Status NcclBackend::Grouped(int result, const char* call) {
  return result == kNcclInProgress ? Status::OK() : Nccl(result, call);
}

Status NcclBackend::LaunchReduce(Request& c, const std::vector<ReducePlan>& plans,
                                 Communicator& comm, Stream stream, const StopCheck& stop) {
  std::vector<int> ops;
  for (size_t i = 0; i < plans.size(); ++i) {
    int op = plans[i].op;
    if (plans[i].premul) {
      KR_RETURN_IF_ERROR(
          comm.PreMulSumOp(plans[i].dtype, c.tensors[i].dtype, plans[i].scalar, stop, &op));
    }
    ops.push_back(op);
  }
  // One call per tensor; on one rank, the pieces NCCL's one-rank kernel writes whole.
  struct Call {
    const char* input;
    char* output;
    size_t count;
    size_t i;
  };
  std::vector<Call> calls;
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    const TensorRef& t = c.tensors[i];
    const size_t count = static_cast<size_t>(t.num_elements());
    const size_t esize = DataTypeSize(t.dtype);
    size_t offset = 0;
    for (size_t piece : size_ == 1 ? OneRankPieces(count, esize) : std::vector<size_t>{count}) {
      if (piece == 0) continue;
      calls.push_back({static_cast<const char*>(t.input) + offset * esize,
                       static_cast<char*>(t.output) + offset * esize, piece, i});
      offset += piece;
    }
  }
  // A grouped allreduce is one NCCL group: one launch for all its tensors.
  const bool group = calls.size() > 1;
  if (group) KR_RETURN_IF_ERROR(Nccl(api_->GroupStart(), "ncclGroupStart"));
  Status s;
  for (size_t k = 0; k < calls.size() && s.ok(); ++k) {
    const Call& call = calls[k];
    const int r = api_->AllReduce(call.input, call.output, call.count, plans[call.i].dtype,
                                  ops[call.i], comm.get(), stream);
    s = group ? Grouped(r, "ncclAllReduce") : comm.Settle(r, "ncclAllReduce", stop);
  }
  // Always close the group: NCCL's group depth is per thread and would outlive an error.
  if (group) {
    const Status end = comm.Settle(api_->GroupEnd(), "ncclGroupEnd", stop);
    if (s.ok()) s = end;
  }
  return s;
}

Status NcclBackend::LaunchAllgather(const std::vector<Signature>& sigs, Request& c,
                                    Communicator& communicator, Stream stream,
                                    const StopCheck& stop) {
  const TensorRef& t = c.tensors[0];
  const GatherPlan g = PlanGather(sigs, DataTypeSize(t.dtype));
  char* out = static_cast<char*>(t.output);
  Comm comm = communicator.get();
  if (g.uniform) {
    return communicator.Settle(
        api_->AllGather(t.input, out, g.bytes[0], kNcclInt8, comm, stream), "ncclAllGather",
        stop);
  }
  // Blocks of different sizes: every rank broadcasts its block into place, in one group.
  KR_RETURN_IF_ERROR(Nccl(api_->GroupStart(), "ncclGroupStart"));
  Status s;
  for (int root = 0; root < size_ && s.ok(); ++root) {
    const size_t r = static_cast<size_t>(root);
    if (g.bytes[r] == 0) continue;
    const void* send = root == rank_ ? t.input : out + g.offset[r];
    s = Grouped(api_->Broadcast(send, out + g.offset[r], g.bytes[r], kNcclInt8, root, comm, stream),
                "ncclBroadcast");
  }
  const Status end = communicator.Settle(api_->GroupEnd(), "ncclGroupEnd", stop);
  return s.ok() ? end : s;
}

void AttachNccl(Runtime& runtime, int device, Stream caller_stream, Request* request,
                const std::shared_ptr<DeviceApi>& api) {
  Executor* executor = runtime.device_executor([&](HostExecutor& host) {
    Runtime* owner = &runtime;  // outlives its executor
    return std::make_unique<NcclBackend>(
        api, host, runtime.rank(), runtime.size(), runtime.options().timeout_seconds,
        runtime.options().device_max_in_flight,
        [owner](Request& r, uint64_t seq, const ExecutionStats& stats, const Status& s) {
          owner->CompleteDeferred(r, seq, stats, s);
        },
        [owner] { return owner->queued() > 0; });
  });
  request->placement = Placement::kDevice;
  // Another device executor would get no ticket and refuse the request (never silently).
  if (auto* backend = dynamic_cast<NcclBackend*>(executor)) {
    request->device_ticket = backend->Prepare(device, caller_stream);
  }
}

}  // namespace nccl
}  // namespace keras_ring
