#include "backend.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>

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

// Polls often at first (most collectives finish within microseconds to milliseconds), then
// sleeps a little longer each time so a long wait costs no CPU (ranks may share cores).
void Backoff(int polls) {
  if (polls < 100) {
    std::this_thread::yield();
    return;
  }
  const int shift = std::min(polls - 100, 5);
  std::this_thread::sleep_for(std::chrono::microseconds(16 << shift));
}

bool NothingToMove(const std::vector<Signature>& sigs, const Request& c) {
  if (c.kind == Kind::kAllgather) {
    return PlanGather(sigs, DataTypeSize(c.tensors[0].dtype)).total == 0;
  }
  for (const TensorRef& t : c.tensors) {
    if (t.num_bytes() > 0) return false;
  }
  return true;
}

std::string Seconds(double s) {
  std::ostringstream out;
  out << s;
  return out.str();
}

int64_t TotalRows(const std::vector<Signature>& sigs) {
  int64_t rows = 0;
  for (const Signature& s : sigs) rows += s.count;
  return rows;
}

}  // namespace

StreamTicket::~StreamTicket() {
  if (ready != nullptr) owner->ReleaseEvent(device, ready);
}

Communicator::~Communicator() {
  if (aborted_) return;  // ncclCommAbort already freed everything
  for (const auto& entry : premul_ops_) api_.RedOpDestroy(entry.second, comm_);
  api_.CommDestroy(comm_);
}

void Communicator::Abort() {
  if (aborted_) return;
  aborted_ = true;
  api_.CommAbort(comm_);
}

Status Communicator::PreMulSumOp(int nccl_dtype, DataType dtype, double scalar, int* op) {
  const auto key = std::make_pair(nccl_dtype, scalar);
  auto it = premul_ops_.find(key);
  if (it != premul_ops_.end()) {
    *op = it->second;
    return Status::OK();
  }
  uint64_t bits = EncodeScalar(dtype, scalar);
  int made = 0;
  const int r =
      api_.RedOpCreatePreMulSum(&made, &bits, nccl_dtype, kNcclScalarHostImmediate, comm_);
  if (r != kNcclSuccess) return NcclError(r, "ncclRedOpCreatePreMulSum", api_.NcclErrorString(r));
  premul_ops_.emplace(key, made);
  *op = made;
  return Status::OK();
}

NcclBackend::NcclBackend(std::shared_ptr<DeviceApi> api, HostExecutor& host, int rank,
                         int size, double timeout_seconds)
    : api_(std::move(api)), host_(host), rank_(rank), size_(size),
      timeout_seconds_(timeout_seconds) {}

NcclBackend::~NcclBackend() {
  ReleaseCommunicators();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& entry : devices_) {
    DeviceState& d = entry.second;
    api_->SetDevice(entry.first);
    for (Event e : d.free_events) api_->EventDestroy(e);
    if (d.stream != nullptr) api_->StreamDestroy(d.stream);
  }
}

void NcclBackend::ReleaseCommunicators() {
  // Every collective completed or was aborted, but ncclCommDestroy still flushes traffic a
  // peer may be receiving, and may wait for the peers' own teardown; after a host-side
  // failure a peer may be gone, so abort instead. Either runs on a helper thread that is
  // given up on (with a warning) at the deadline, so shutdown never hangs.
  std::vector<std::pair<int, std::unique_ptr<Communicator>>> comms;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& entry : devices_) {
      if (entry.second.comm) comms.emplace_back(entry.first, std::move(entry.second.comm));
    }
  }
  if (comms.empty()) return;
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread helper([api = api_, comms = std::move(comms), done,
                      abort = peer_failed_.load()]() mutable {
    for (auto& entry : comms) {
      api->SetDevice(entry.first);
      if (abort) entry.second->Abort();
      entry.second.reset();
    }
    done->store(true);
  });
  const Deadline deadline = Deadline::After(std::min(timeout_seconds_, 60.0));
  while (!done->load() && !deadline.expired()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (done->load()) {
    helper.join();
    return;
  }
  helper.detach();
  std::fprintf(stderr,
               "keras_ring: WARNING: NCCL communicator teardown did not finish within %s s (a "
               "peer may have exited without keras_ring.shutdown()); continuing without it\n",
               Seconds(std::min(timeout_seconds_, 60.0)).c_str());
}

void NcclBackend::Abort() { aborted_.store(true); }

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
  // The caller's thread may be working on another device; leave it as it was.
  int previous = -1;
  const bool restore = api_->GetDevice(&previous) == kCudaSuccess && previous != device;
  Status s = Cuda(api_->SetDevice(device), "cudaSetDevice");
  Event ready = nullptr;
  if (s.ok()) s = TakeEvent(device, &ready);
  if (s.ok()) {
    ticket->ready = ready;
    s = Cuda(api_->EventRecord(ready, caller_stream), "cudaEventRecord");
  }
  if (restore) api_->SetDevice(previous);
  ticket->status = s;
  return ticket;
}

Status NcclBackend::Execute(Request& request, uint64_t seq, ExecutionStats* stats) {
  auto* ticket = dynamic_cast<StreamTicket*>(request.device_ticket.get());
  if (ticket == nullptr) {
    return Status(Code::kInternal, "a device collective without NCCL's ticket reached NCCL");
  }
  std::vector<Signature> sigs;
  bool inlined = false;  // never: device data does not ride in the slots
  KR_RETURN_IF_ERROR(host_.Agree(request, seq, &sigs, &inlined));
  stats->agreed = Clock::now();
  return Run(host_.transport(), sigs, request, *ticket);
}

Status NcclBackend::Run(Transport& control, const std::vector<Signature>& sigs, Request& c,
                        StreamTicket& ticket) {
  // Everything decided before the first NCCL call depends only on the agreed signatures, so
  // every rank takes the same branch and a refusal is an ordinary, non-fatal error.
  std::vector<ReducePlan> plans;
  if (c.kind == Kind::kAllreduce || c.kind == Kind::kGroupedAllreduce) {
    for (const TensorRef& t : c.tensors) {
      plans.emplace_back();
      KR_RETURN_IF_ERROR(
          PlanReduce(t.dtype, c.op, c.prescale, c.postscale, size_, &plans.back()));
    }
  }
  if (c.kind == Kind::kBarrier) return Status::OK();
  if (NothingToMove(sigs, c)) {
    if (c.kind != Kind::kAllgather) return Status::OK();
    return c.allocate_output(TotalRows(sigs), &c.tensors[0].output);
  }
  KR_RETURN_IF_ERROR(Ready(control, ticket));
  return RunOnStream(sigs, c, plans, ticket, State(ticket.device));
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
  d.comm->Abort();
  return Status(Code::kAborted, local.message());
}

Status NcclBackend::RunOnStream(const std::vector<Signature>& sigs, Request& c,
                                const std::vector<ReducePlan>& plans, StreamTicket& ticket,
                            DeviceState& d) {
  Communicator& comm = *d.comm;
  Event ready = ticket.ready;
  Event allocated = nullptr;
  Event done = nullptr;
  Status s;
  if (c.kind == Kind::kAllgather) {
    s = c.allocate_output(TotalRows(sigs), &c.tensors[0].output);
    if (!s.ok()) {
      s = Status(Code::kAborted, "could not allocate the allgather output: " + s.message());
    }
    // The new output may reuse memory that work queued on the caller's stream after the
    // submission still reads: start after everything queued there so far.
    if (s.ok()) s = TakeEvent(ticket.device, &allocated);
    if (s.ok()) s = Cuda(api_->EventRecord(allocated, ticket.caller_stream), "cudaEventRecord");
    ready = allocated;
  }
  if (s.ok()) s = Cuda(api_->StreamWaitEvent(d.stream, ready), "cudaStreamWaitEvent");
  if (s.ok()) s = Launch(sigs, c, plans, comm, d.stream);
  if (s.ok()) s = TakeEvent(ticket.device, &done);
  if (s.ok()) s = Cuda(api_->EventRecord(done, d.stream), "cudaEventRecord");
  if (s.ok()) s = Cuda(api_->StreamWaitEvent(ticket.caller_stream, done), "cudaStreamWaitEvent");
  if (s.ok()) {
    s = WaitFor(done, comm, KindName(c.kind));
  } else {
    comm.Abort();  // the peers may be inside the collective already
  }
  if (done != nullptr) ReleaseEvent(ticket.device, done);
  if (allocated != nullptr) ReleaseEvent(ticket.device, allocated);
  return s;
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
  Comm comm = nullptr;
  KR_RETURN_IF_ERROR(InitCommunicator(device, id.id, &comm));
  State(device).comm = std::make_unique<Communicator>(*api_, comm);
  return Status::OK();
}

Status NcclBackend::StopReason(const Deadline& deadline, const std::string& what) {
  if (aborted_.load()) {
    return Status(Code::kAborted, "keras_ring shut down while " + what + " was running");
  }
  KR_RETURN_IF_ERROR(InterruptStatus());
  if (deadline.expired()) {
    return Status(Code::kDeadlineExceeded,
                  what + " did not complete within " + Seconds(timeout_seconds_) +
                      " s; a peer may have stalled or died");
  }
  return Status::OK();
}

Status NcclBackend::InitCommunicator(int device, const UniqueId& id, Comm* out) {
  // ncclCommInitRank blocks until every rank joined. It runs on a helper thread so that
  // this wait is bounded like every other: a helper abandoned at the deadline aborts the
  // communicator itself if it is ever made.
  struct Job {
    std::mutex mu;
    std::condition_variable cv;
    bool finished = false;
    bool abandoned = false;
    Comm comm = nullptr;
    int cuda = kCudaSuccess;
    int result = kNcclSuccess;
  };
  auto job = std::make_shared<Job>();
  std::thread helper([job, api = api_, device, id, rank = rank_, size = size_] {
    Comm comm = nullptr;
    const int cuda = api->SetDevice(device);
    const int result = cuda == kCudaSuccess ? api->CommInitRank(&comm, size, id, rank)
                                            : kNcclSuccess;
    std::lock_guard<std::mutex> lock(job->mu);
    if (job->abandoned) {
      if (cuda == kCudaSuccess && result == kNcclSuccess) api->CommAbort(comm);
    } else {
      job->comm = comm;
      job->cuda = cuda;
      job->result = result;
    }
    job->finished = true;
    job->cv.notify_all();
  });
  const Deadline deadline = Deadline::After(timeout_seconds_);
  std::unique_lock<std::mutex> lock(job->mu);
  while (!job->finished) {
    Status stop = StopReason(deadline, "ncclCommInitRank");
    if (!stop.ok()) {
      job->abandoned = true;
      lock.unlock();
      helper.detach();
      return stop;
    }
    job->cv.wait_for(lock, std::chrono::milliseconds(20));
  }
  lock.unlock();
  helper.join();
  KR_RETURN_IF_ERROR(Cuda(job->cuda, "cudaSetDevice"));
  KR_RETURN_IF_ERROR(Nccl(job->result, "ncclCommInitRank"));
  *out = job->comm;
  return Status::OK();
}

Status NcclBackend::Launch(const std::vector<Signature>& sigs, Request& c,
                           const std::vector<ReducePlan>& plans, Communicator& comm,
                           Stream stream) {
  switch (c.kind) {
    case Kind::kAllreduce:
    case Kind::kGroupedAllreduce:
      return LaunchReduce(c, plans, comm, stream);
    case Kind::kAllgather:
      return LaunchAllgather(sigs, c, comm.get(), stream);
    case Kind::kBroadcast: {
      // Raw bytes: any dtype (bool included) broadcasts alike.
      const TensorRef& t = c.tensors[0];
      return Nccl(api_->Broadcast(t.input, t.output, t.num_bytes(), kNcclInt8, c.root,
                                  comm.get(), stream),
                  "ncclBroadcast");
    }
    case Kind::kBarrier:
      break;
    case Kind::kReducescatter:
    case Kind::kAlltoall:  // their ops have CPU kernels only: TensorFlow stages GPU tensors
      return Status(Code::kInvalidArgument,
                    std::string(KindName(c.kind)) + " has no NCCL implementation yet");
  }
  return Status::OK();
}

Status NcclBackend::LaunchReduce(Request& c, const std::vector<ReducePlan>& plans,
                                 Communicator& comm, Stream stream) {
  std::vector<int> ops;
  for (size_t i = 0; i < plans.size(); ++i) {
    int op = plans[i].op;
    if (plans[i].premul) {
      KR_RETURN_IF_ERROR(
          comm.PreMulSumOp(plans[i].dtype, c.tensors[i].dtype, plans[i].scalar, &op));
    }
    ops.push_back(op);
  }
  // A grouped allreduce is one NCCL group: one launch for all its tensors.
  const bool group = c.tensors.size() > 1;
  if (group) KR_RETURN_IF_ERROR(Nccl(api_->GroupStart(), "ncclGroupStart"));
  Status s;
  for (size_t i = 0; i < c.tensors.size() && s.ok(); ++i) {
    const TensorRef& t = c.tensors[i];
    const size_t count = static_cast<size_t>(t.num_elements());
    if (count == 0) continue;
    s = Nccl(api_->AllReduce(t.input, t.output, count, plans[i].dtype, ops[i], comm.get(), stream),
             "ncclAllReduce");
  }
  // Always close the group: NCCL's group depth is per thread and would outlive an error.
  if (group) {
    const Status end = Nccl(api_->GroupEnd(), "ncclGroupEnd");
    if (s.ok()) s = end;
  }
  return s;
}

Status NcclBackend::LaunchAllgather(const std::vector<Signature>& sigs, Request& c,
                                    Comm comm, Stream stream) {
  const TensorRef& t = c.tensors[0];
  const GatherPlan g = PlanGather(sigs, DataTypeSize(t.dtype));
  char* out = static_cast<char*>(t.output);
  if (g.uniform) {
    return Nccl(api_->AllGather(t.input, out, g.bytes[0], kNcclInt8, comm, stream),
                "ncclAllGather");
  }
  // Blocks of different sizes: every rank broadcasts its block into place, in one group.
  KR_RETURN_IF_ERROR(Nccl(api_->GroupStart(), "ncclGroupStart"));
  Status s;
  for (int root = 0; root < size_ && s.ok(); ++root) {
    const size_t r = static_cast<size_t>(root);
    if (g.bytes[r] == 0) continue;
    const void* send = root == rank_ ? t.input : out + g.offset[r];
    s = Nccl(api_->Broadcast(send, out + g.offset[r], g.bytes[r], kNcclInt8, root, comm, stream),
             "ncclBroadcast");
  }
  const Status end = Nccl(api_->GroupEnd(), "ncclGroupEnd");
  return s.ok() ? end : s;
}

Status NcclBackend::WaitFor(Event done, Communicator& comm, const char* what) {
  const Deadline deadline = Deadline::After(timeout_seconds_);
  const std::string label = std::string("NCCL ") + what;
  for (int polls = 0;; ++polls) {
    const int q = api_->EventQuery(done);
    if (q == kCudaSuccess) return Status::OK();
    Status s = q == kCudaErrorNotReady ? Status::OK() : Cuda(q, "cudaEventQuery");
    int async = kNcclSuccess;
    if (s.ok()) s = Nccl(api_->CommGetAsyncError(comm.get(), &async), "ncclCommGetAsyncError");
    if (s.ok() && async != kNcclSuccess && async != kNcclInProgress) {
      s = Nccl(async, label.c_str());
    }
    if (s.ok()) s = StopReason(deadline, label);
    if (!s.ok()) {
      comm.Abort();
      return Status(s.code(), s.message() + " (its NCCL communicator was aborted)", s.peer());
    }
    Backoff(polls);
  }
}

void AttachNccl(Runtime& runtime, int device, Stream caller_stream, Request* request,
                const std::shared_ptr<DeviceApi>& api) {
  Executor* executor = runtime.device_executor([&](HostExecutor& host) {
    return std::make_unique<NcclBackend>(api, host, runtime.rank(), runtime.size(),
                                         runtime.options().timeout_seconds);
  });
  request->placement = Placement::kDevice;
  // Another device executor would get no ticket and refuse the request (never silently).
  if (auto* backend = dynamic_cast<NcclBackend*>(executor)) {
    request->device_ticket = backend->Prepare(device, caller_stream);
  }
}

}  // namespace nccl
}  // namespace keras_ring
