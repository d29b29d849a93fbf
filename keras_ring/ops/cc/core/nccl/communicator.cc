#include "communicator.h"

#include <chrono>
#include <cstdio>
#include <mutex>
#include <thread>

#include "plan.h"

namespace keras_ring {
namespace nccl {

namespace {

// Said once per process: a blocking communicator is a weaker guarantee than the rest of the
// runtime gives, and the fix is an upgrade.
void NoteBlockingOnce(DeviceApi& api) {
  static std::once_flag once;
  std::call_once(once, [&api] {
    int version = 0;
    api.NcclVersion(&version);
    std::fprintf(stderr,
                 "keras_ring: NOTE: NCCL %s has no ncclCommInitRankConfig (NCCL >= 2.14): its "
                 "communicators are blocking, so their setup and teardown are not bounded by "
                 "KERAS_RING_TIMEOUT_SECONDS and cannot be aborted safely; pip install -U "
                 "nvidia-nccl-cu12 (or nvidia-nccl-cu13) to get nonblocking ones\n",
                 NcclVersionString(version).c_str());
  });
}

}  // namespace

void PollBackoff(int polls) {
  if (polls < 100) {
    std::this_thread::yield();
    return;
  }
  const int shift = std::min(polls - 100, 5);
  std::this_thread::sleep_for(std::chrono::microseconds(16 << shift));
}

Status Communicator::Create(DeviceApi& api, int nranks, const UniqueId& id, int rank,
                            const StopCheck& stop, std::unique_ptr<Communicator>* out) {
  Comm comm = nullptr;
  if (!api.HasNonblockingComms()) {
    NoteBlockingOnce(api);
    const int r = api.CommInitRank(&comm, nranks, id, rank);  // until every rank joined
    if (r != kNcclSuccess) return NcclError(r, "ncclCommInitRank", api.NcclErrorString(r));
    out->reset(new Communicator(api, comm, false));
    return Status::OK();
  }
  NcclConfig config = NonblockingConfig();
  const int r = api.CommInitRankConfig(&comm, nranks, id, rank, &config);
  if (comm == nullptr) {  // refused before anything was made (NCCL sets it to null then)
    const int result = r == kNcclSuccess || r == kNcclInProgress ? kNcclInternalError : r;
    return NcclError(result, "ncclCommInitRankConfig", api.NcclErrorString(result));
  }
  std::unique_ptr<Communicator> made(new Communicator(api, comm, true));
  const Status s = made->Settle(r, "ncclCommInitRankConfig", stop);
  if (!s.ok()) {
    made->Abort();  // NCCL's rule for a communicator whose setup failed or was given up on
    return s;
  }
  *out = std::move(made);
  return Status::OK();
}

Communicator::~Communicator() {
  if (!aborted_ && !closed_) Abort();
}

void Communicator::Abort() {
  if (aborted_ || closed_) return;
  aborted_ = true;
  api_.CommAbort(comm_);  // frees everything, the ops included
}

Status Communicator::Settle(int result, const std::string& call, const StopCheck& stop) {
  for (int polls = 0; result == kNcclInProgress; ++polls) {
    KR_RETURN_IF_ERROR(stop(call));
    PollBackoff(polls);
    int state = kNcclInProgress;
    const int q = api_.CommGetAsyncError(comm_, &state);
    result = q != kNcclSuccess ? q : state;
  }
  return result == kNcclSuccess ? Status::OK()
                                : NcclError(result, call, api_.NcclErrorString(result));
}

Status Communicator::AsyncError(const std::string& what) {
  int state = kNcclSuccess;
  const int q = api_.CommGetAsyncError(comm_, &state);
  if (q != kNcclSuccess) return NcclError(q, "ncclCommGetAsyncError", api_.NcclErrorString(q));
  if (state == kNcclSuccess || state == kNcclInProgress) return Status::OK();
  return NcclError(state, what, api_.NcclErrorString(state));
}

Status Communicator::PreMulSumOp(int nccl_dtype, DataType dtype, double scalar,
                                 const StopCheck& stop, int* op) {
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
  KR_RETURN_IF_ERROR(Settle(r, "ncclRedOpCreatePreMulSum", stop));
  premul_ops_.emplace(key, made);
  *op = made;
  return Status::OK();
}

bool Communicator::Close(const Deadline& deadline) {
  if (aborted_ || closed_) return !aborted_;
  const StopCheck until_deadline = [&deadline](const std::string& what) {
    return deadline.expired() ? Status(Code::kDeadlineExceeded, what + " did not finish")
                              : Status::OK();
  };
  Status s;
  for (const auto& entry : premul_ops_) {
    if (s.ok()) s = Settle(api_.RedOpDestroy(entry.second, comm_), "ncclRedOpDestroy",
                           until_deadline);
  }
  // Finalize flushes what peers may still be receiving and waits until they are done with
  // the communicator; after it, destroy only frees local memory.
  if (s.ok() && nonblocking_) {
    s = Settle(api_.CommFinalize(comm_), "ncclCommFinalize", until_deadline);
  }
  if (!s.ok()) {
    Abort();
    return false;
  }
  closed_ = true;
  api_.CommDestroy(comm_);  // blocking communicators (NCCL < 2.14) flush here, unbounded
  return true;
}

}  // namespace nccl
}  // namespace keras_ring
