#include "nccl_fake.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "../core/reduce.h"

namespace kr_test {

namespace kn = keras_ring::nccl;
using keras_ring::DataType;
using keras_ring::ReduceOp;

namespace {

double DecodeScalar(DataType t, const void* p) {
  uint16_t h = 0;
  switch (t) {
    case DataType::kFloat16: std::memcpy(&h, p, 2); return keras_ring::HalfToFloat(h);
    case DataType::kBFloat16: std::memcpy(&h, p, 2); return keras_ring::BFloat16ToFloat(h);
    case DataType::kFloat32: { float f; std::memcpy(&f, p, 4); return f; }
    default: { double d; std::memcpy(&d, p, 8); return d; }
  }
}

}  // namespace

keras_ring::Status FakeDeviceApi::LoadNccl() {
  std::lock_guard<std::mutex> lock(world_->mu_);
  const std::string& e = world_->ranks_[static_cast<size_t>(rank_)].nccl_error;
  return e.empty() ? keras_ring::Status::OK()
                   : keras_ring::Status(keras_ring::Code::kFailedPrecondition, e);
}

std::string FakeDeviceApi::Name(const void* handle) {
  if (handle == CallerStream(rank_)) return "caller";
  auto it = names_.find(handle);
  return it != names_.end() ? it->second : "?";
}

int FakeDeviceApi::HasCurrentContext(bool* has) {
  std::lock_guard<std::mutex> lock(mu_);
  *has = current_.count(std::this_thread::get_id()) > 0;
  return 0;
}

int FakeDeviceApi::GetDevice(int* device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = current_.find(std::this_thread::get_id());
  *device = it != current_.end() ? it->second : 0;  // CUDA's answer without a context
  return 0;
}

int FakeDeviceApi::SetDevice(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  current_[std::this_thread::get_id()] = device;
  if (contexts_.insert(device).second) {  // CUDA 12 makes the primary context right here
    std::lock_guard<std::mutex> wlock(world_->mu_);
    world_->Note(rank_, "context " + std::to_string(device));
  }
  return 0;
}

int FakeDeviceApi::StreamCreate(kn::Stream* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  *stream = reinterpret_cast<kn::Stream>(static_cast<uintptr_t>(next_handle_));
  names_[*stream] = "stream" + std::to_string(next_handle_++);
  std::lock_guard<std::mutex> wlock(world_->mu_);
  world_->ranks_[static_cast<size_t>(rank_)].live++;
  return 0;
}

int FakeDeviceApi::StreamDestroy(kn::Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  std::lock_guard<std::mutex> wlock(world_->mu_);
  world_->Note(rank_, "destroy " + Name(stream));
  world_->ranks_[static_cast<size_t>(rank_)].live--;
  return 0;
}

int FakeDeviceApi::EventCreate(kn::Event* event) {
  std::lock_guard<std::mutex> lock(mu_);
  *event = reinterpret_cast<kn::Event>(static_cast<uintptr_t>(next_handle_));
  names_[*event] = "event" + std::to_string(next_handle_++);
  std::lock_guard<std::mutex> wlock(world_->mu_);
  world_->ranks_[static_cast<size_t>(rank_)].live++;
  return 0;
}

int FakeDeviceApi::EventDestroy(kn::Event event) {
  std::lock_guard<std::mutex> lock(mu_);
  std::lock_guard<std::mutex> wlock(world_->mu_);
  world_->Note(rank_, "destroy " + Name(event));
  world_->ranks_[static_cast<size_t>(rank_)].live--;
  return 0;
}

int FakeDeviceApi::EventRecord(kn::Event event, kn::Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  std::lock_guard<std::mutex> wlock(world_->mu_);
  // Completed launches no longer hold anything back (and a long run stays cheap).
  std::vector<std::shared_ptr<bool>>& pending = streams_[stream];
  pending.erase(std::remove_if(pending.begin(), pending.end(),
                               [this](const std::shared_ptr<bool>& done) {
                                 return world_->Reached(done);
                               }),
                pending.end());
  events_[event] = pending;
  event_polls_left_[event] = world_->event_polls.load();
  for (const auto& entry : comms_) {
    if (entry.second.busy != Busy::kNone && entry.second.stream == stream) {
      world_->Note(rank_, "violation: record on " + Name(stream) + " while its launch runs");
    }
  }
  world_->Note(rank_, "record " + Name(event) + "@" + Name(stream));
  return 0;
}

int FakeDeviceApi::StreamWaitEvent(kn::Stream stream, kn::Event event) {
  std::lock_guard<std::mutex> lock(mu_);
  std::lock_guard<std::mutex> wlock(world_->mu_);
  world_->Note(rank_, "wait " + Name(stream) + ":" + Name(event));
  return 0;
}

int FakeDeviceApi::EventQuery(kn::Event event) {
  std::lock_guard<std::mutex> lock(mu_);
  std::lock_guard<std::mutex> wlock(world_->mu_);
  for (const auto& done : events_[event]) {
    if (!world_->Reached(done)) return kn::kCudaErrorNotReady;
  }
  int& left = event_polls_left_[event];
  if (left > 0) {
    --left;
    return kn::kCudaErrorNotReady;
  }
  return 0;
}

int FakeDeviceApi::GetUniqueId(kn::UniqueId* id) {
  std::lock_guard<std::mutex> lock(world_->mu_);
  std::memset(id, 0, sizeof *id);
  const std::string text = "fake-nccl-id-" + std::to_string(world_->next_id_++);
  std::memcpy(id->internal, text.data(), text.size());
  world_->Note(rank_, "uniqueid");
  return 0;
}

int FakeDeviceApi::MakeComm(kn::Comm* comm, const kn::UniqueId& id, bool nonblocking) {
  std::lock_guard<std::mutex> lock(mu_);
  *comm = reinterpret_cast<kn::Comm>(static_cast<uintptr_t>(next_handle_));
  names_[*comm] = "comm" + std::to_string(next_handle_++);
  CommInfo& info = comms_[*comm];
  info.id = std::string(id.internal);
  info.nonblocking = nonblocking;
  info.busy = nonblocking ? Busy::kInit : Busy::kNone;
  return nonblocking ? kn::kNcclInProgress : 0;
}

int FakeDeviceApi::CommInitRank(kn::Comm* comm, int nranks, const kn::UniqueId& id, int rank) {
  {
    std::unique_lock<std::mutex> wlock(world_->mu_);
    while (world_->block_init.load()) world_->cv_.wait_for(wlock, std::chrono::milliseconds(5));
    world_->Note(rank_,
                 "init " + std::to_string(rank) + "/" + std::to_string(nranks) + " blocking");
    const int result = world_->ranks_[static_cast<size_t>(rank_)].init_result;
    if (result != 0) return result;
    world_->comms_[std::string(id.internal)].joined++;
  }
  return MakeComm(comm, id, false);
}

int FakeDeviceApi::CommInitRankConfig(kn::Comm* comm, int nranks, const kn::UniqueId& id,
                                      int rank, kn::NcclConfig* config) {
  // What NCCL checks of the config it is handed (see abi.h).
  if (config->size < kn::kNcclConfigBytes || config->magic != 0xcafebeefu ||
      config->version < 21400 || (config->blocking != 0 && config->blocking != 1)) {
    *comm = nullptr;
    return kn::kNcclInvalidArgument;
  }
  {
    std::lock_guard<std::mutex> wlock(world_->mu_);
    world_->Note(rank_, "init " + std::to_string(rank) + "/" + std::to_string(nranks) +
                            (config->blocking ? " blocking" : " nonblocking"));
    world_->comms_[std::string(id.internal)].joined++;
  }
  return MakeComm(comm, id, config->blocking == 0);
}

int FakeDeviceApi::AsyncState(const void* comm) {
  CommInfo& info = comms_[comm];
  FakeNcclWorld::CommState& c = world_->comms_[info.id];
  switch (info.busy) {
    case Busy::kNone:
      return 0;
    case Busy::kInit:
      if (world_->block_init.load() || c.joined < world_->size_) return kn::kNcclInProgress;
      info.busy = Busy::kNone;
      return world_->ranks_[static_cast<size_t>(rank_)].init_result;
    case Busy::kLaunch:
      if (world_->launch_stuck.load() || info.polls_left-- > 0) return kn::kNcclInProgress;
      break;
    case Busy::kFinalize:
      if (c.finalized < world_->size_) return kn::kNcclInProgress;
      break;
  }
  info.busy = Busy::kNone;
  return 0;
}

void FakeDeviceApi::CheckIdle(const void* comm, const std::string& call) {
  const CommInfo& info = comms_[comm];
  if (info.aborted) world_->Note(rank_, "violation: " + call + " on an aborted communicator");
  if (info.busy != Busy::kNone) world_->Note(rank_, "violation: " + call + " while in progress");
}

int FakeDeviceApi::CommGetAsyncError(kn::Comm comm, int* async_error) {
  std::lock_guard<std::mutex> lock(mu_);
  std::lock_guard<std::mutex> wlock(world_->mu_);
  if (comms_[comm].aborted) world_->Note(rank_, "violation: poll of an aborted communicator");
  world_->Note(rank_, "poll");
  const bool setting_up = comms_[comm].busy == Busy::kInit;  // the knob is for later errors
  const int busy = AsyncState(comm);
  const bool inject = !setting_up && world_->async_error_rank.load() == rank_;
  *async_error = inject ? world_->async_error.load() : busy;
  return 0;
}

int FakeDeviceApi::CommAbort(kn::Comm comm) {
  std::lock_guard<std::mutex> lock(mu_);
  comms_[comm].aborted = true;
  comms_[comm].busy = Busy::kNone;
  std::lock_guard<std::mutex> wlock(world_->mu_);
  world_->Note(rank_, "abort");
  return 0;
}

int FakeDeviceApi::CommFinalize(kn::Comm comm) {
  std::lock_guard<std::mutex> lock(mu_);
  std::lock_guard<std::mutex> wlock(world_->mu_);
  CheckIdle(comm, "finalize");
  CommInfo& info = comms_[comm];
  world_->comms_[info.id].finalized++;
  world_->Note(rank_, "finalize");
  if (!info.nonblocking) return 0;
  info.busy = Busy::kFinalize;
  return kn::kNcclInProgress;
}

int FakeDeviceApi::CommDestroy(kn::Comm comm) {
  std::lock_guard<std::mutex> lock(mu_);
  std::lock_guard<std::mutex> wlock(world_->mu_);
  CheckIdle(comm, "destroy");
  world_->Note(rank_, "destroy comm");
  return 0;
}

int FakeDeviceApi::GroupStart() {
  std::lock_guard<std::mutex> lock(mu_);
  in_group_ = true;
  std::lock_guard<std::mutex> wlock(world_->mu_);
  world_->Note(rank_, "group start");
  return 0;
}

int FakeDeviceApi::GroupEnd() {
  std::vector<FakeCall> calls;
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_group_ = false;
    calls.swap(group_);
    std::lock_guard<std::mutex> wlock(world_->mu_);
    world_->Note(rank_, "group end");
  }
  if (calls.empty()) return 0;
  return Submit(std::move(calls), const_cast<kn::Comm>(static_cast<const kn::CommObject*>(group_comm_)),
                const_cast<kn::Stream>(group_stream_));
}

namespace {

FakeCall MakeCall(FakeCall::Type type, const void* send, void* recv, size_t count, int dtype,
                  int op, int root) {
  FakeCall call;
  call.type = type;
  call.send = send;
  call.recv = recv;
  call.count = count;
  call.dtype = dtype;
  call.op = op;
  call.root = root;
  return call;
}

// NCCL counts elements; broadcast, allgather and point to point are compared as bytes here.
size_t Bytes(size_t count, int dtype) { return count * keras_ring::DataTypeSize(FromNccl(dtype)); }

const char* CallName(FakeCall::Type type) {
  switch (type) {
    case FakeCall::kAllReduce: return "allreduce";
    case FakeCall::kBroadcast: return "broadcast";
    case FakeCall::kAllGather: return "allgather";
    case FakeCall::kReduce: return "reduce";
    case FakeCall::kReduceScatter: return "reducescatter";
    case FakeCall::kSend: return "send";
    case FakeCall::kRecv: return "recv";
  }
  return "?";
}

}  // namespace

int FakeDeviceApi::Enqueue(const FakeCall& call, kn::Comm comm, kn::Stream stream) {
  std::string note;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const char* what = CallName(call.type);
    std::lock_guard<std::mutex> wlock(world_->mu_);
    CheckIdle(comm, what);
    // NCCL allows it, but two ranks sending to each other outside a group deadlock.
    if (call.p2p() && !in_group_) world_->Note(rank_, std::string("violation: ungrouped ") + what);
    note = std::string(what) + "@" + Name(stream) +
           (call.p2p() ? " peer " + std::to_string(call.root) : "");
    if (in_group_) {
      world_->Note(rank_, note);
      group_.push_back(call);
      group_comm_ = comm;
      group_stream_ = stream;
      return 0;
    }
  }
  return Submit({call}, comm, stream, note);
}

int FakeDeviceApi::Submit(std::vector<FakeCall> calls, kn::Comm comm, kn::Stream stream,
                          const std::string& note) {
  if (world_->on_launch) world_->on_launch(rank_);
  std::lock_guard<std::mutex> lock(mu_);
  CommInfo& info = comms_[comm];
  std::lock_guard<std::mutex> wlock(world_->mu_);
  if (!note.empty()) world_->Note(rank_, note);
  if (info.aborted) return kn::kNcclInvalidUsage;
  FakeNcclWorld::CommState& c = world_->comms_[info.id];
  const bool p2p = calls.front().p2p();
  for (const FakeCall& call : calls) {
    if (call.p2p() != p2p) world_->Note(rank_, "violation: collectives and send/recv in one group");
  }
  if (p2p) {
    streams_[stream].push_back(world_->PostP2p(c, rank_, calls));
  } else {
    const int seq = c.next_seq[rank_]++;
    FakeNcclWorld::Launch& launch = c.launches[seq];
    launch.calls.resize(static_cast<size_t>(world_->size_));
    launch.calls[static_cast<size_t>(rank_)] = std::move(calls);
    streams_[stream].push_back(launch.done);
    const int hang_from = world_->hang_from_launch.load();
    if (++launch.arrived == world_->size_ && !world_->hang.load() && !world_->hold.load() &&
        (hang_from < 0 || seq < hang_from)) {
      world_->Execute(c, launch);
    }
    int pending = 0;
    for (const auto& done : streams_[stream]) pending += *done ? 0 : 1;
    int& most = world_->ranks_[static_cast<size_t>(rank_)].max_pending;
    most = std::max(most, pending);
  }
  info.stream = stream;
  if (!info.nonblocking || (world_->launch_polls.load() == 0 && !world_->launch_stuck.load())) {
    return 0;
  }
  info.busy = Busy::kLaunch;
  info.polls_left = world_->launch_polls.load();
  return kn::kNcclInProgress;
}

int FakeDeviceApi::AllReduce(const void* send, void* recv, size_t count, int dtype, int op,
                             kn::Comm comm, kn::Stream stream) {
  return Enqueue(MakeCall(FakeCall::kAllReduce, send, recv, count, dtype, op, 0), comm, stream);
}

int FakeDeviceApi::Broadcast(const void* send, void* recv, size_t count, int dtype, int root,
                             kn::Comm comm, kn::Stream stream) {
  return Enqueue(MakeCall(FakeCall::kBroadcast, send, recv, Bytes(count, dtype), dtype, 0, root),
                 comm, stream);
}

int FakeDeviceApi::AllGather(const void* send, void* recv, size_t count, int dtype,
                             kn::Comm comm, kn::Stream stream) {
  return Enqueue(MakeCall(FakeCall::kAllGather, send, recv, Bytes(count, dtype), dtype, 0, 0),
                 comm, stream);
}

int FakeDeviceApi::Reduce(const void* send, void* recv, size_t count, int dtype, int op, int root,
                          kn::Comm comm, kn::Stream stream) {
  return Enqueue(MakeCall(FakeCall::kReduce, send, recv, count, dtype, op, root), comm, stream);
}

int FakeDeviceApi::ReduceScatter(const void* send, void* recv, size_t recv_count, int dtype,
                                 int op, kn::Comm comm, kn::Stream stream) {
  return Enqueue(MakeCall(FakeCall::kReduceScatter, send, recv, recv_count, dtype, op, 0), comm,
                 stream);
}

int FakeDeviceApi::Send(const void* send, size_t count, int dtype, int peer, kn::Comm comm,
                        kn::Stream stream) {
  return Enqueue(MakeCall(FakeCall::kSend, send, nullptr, Bytes(count, dtype), dtype, 0, peer),
                 comm, stream);
}

int FakeDeviceApi::Recv(void* recv, size_t count, int dtype, int peer, kn::Comm comm,
                        kn::Stream stream) {
  return Enqueue(MakeCall(FakeCall::kRecv, nullptr, recv, Bytes(count, dtype), dtype, 0, peer),
                 comm, stream);
}

int FakeDeviceApi::RedOpCreatePreMulSum(int* op, void* scalar, int dtype, int residence,
                                        kn::Comm comm) {
  if (residence != kn::kNcclScalarHostImmediate) return kn::kNcclInvalidArgument;
  std::string id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = comms_[comm].id;
  }
  std::lock_guard<std::mutex> wlock(world_->mu_);
  FakeNcclWorld::CommState& c = world_->comms_[id];
  // Every rank makes the same ops in the same order, so ids agree like NCCL's do.
  const double value = DecodeScalar(FromNccl(dtype), scalar);
  for (const auto& entry : c.premul_scalars) {
    if (entry.second == value) {
      *op = entry.first;
      world_->Note(rank_, "premul " + std::to_string(value));
      return 0;
    }
  }
  *op = c.next_op++;
  c.premul_scalars[*op] = value;
  world_->Note(rank_, "premul " + std::to_string(value));
  return 0;
}

int FakeDeviceApi::RedOpDestroy(int, kn::Comm) {
  std::lock_guard<std::mutex> wlock(world_->mu_);
  world_->Note(rank_, "destroy premul");
  return 0;
}

}  // namespace kr_test
