// NCCL launches of reducescatter and alltoall (the others are in backend.cc).
//
// Reducescatter splits rows as Horovod does (the first rows % size ranks get one row more).
// ncclReduceScatter takes equal blocks only, at offsets r * recvcount, so it serves exactly
// the even case, which is also the common one (and NCCL's bandwidth-optimal algorithm). For
// uneven parts, each part is one ncclReduce with its owner as root, all in one group: the
// parts stay where they lie in the input (no scratch buffer, no copies, nothing to allocate
// on the device), each byte crosses the ring once as in a reduce-scatter, and empty parts
// (rows < size) are simply skipped on every rank. ncclReduceScatter on the even prefix plus a
// remainder would need the input rearranged first, since the uneven layout shifts every
// block after the first.
//
// Alltoall is a group of ncclSend / ncclRecv per peer (itself included: NCCL copies that),
// bytes typed as int8, so every dtype, bool too, moves alike. Empty transfers are skipped;
// NCCL pairs the k-th send from p to q with the k-th receive on q from p within the group.
#include "backend.h"

namespace keras_ring {
namespace nccl {

Status NcclBackend::LaunchReducescatter(Request& c, const ReducePlan& plan,
                                        Communicator& communicator, Stream stream,
                                        const StopCheck& stop) {
  // One rank's part is the whole input: an allreduce, which also takes NCCL's one-rank
  // kernel in the pieces it writes whole (plan.h).
  if (size_ == 1) return LaunchReduce(c, {plan}, communicator, stream, stop);
  const TensorRef& t = c.tensors[0];
  int op = plan.op;
  if (plan.premul) {
    KR_RETURN_IF_ERROR(communicator.PreMulSumOp(plan.dtype, t.dtype, plan.scalar, stop, &op));
  }
  const int64_t rows = t.shape.empty() ? 1 : t.shape[0];  // > 0: empty inputs never get here
  const ScatterPlan parts = PlanScatter(rows, t.num_elements() / rows, size_);
  Comm comm = communicator.get();
  if (parts.uniform) {
    return communicator.Settle(
        api_->ReduceScatter(t.input, t.output, parts.count[0], plan.dtype, op, comm, stream),
        "ncclReduceScatter", stop);
  }
  const char* in = static_cast<const char*>(t.input);
  const size_t esize = DataTypeSize(t.dtype);
  KR_RETURN_IF_ERROR(Nccl(api_->GroupStart(), "ncclGroupStart"));
  Status s;
  for (int root = 0; root < size_ && s.ok(); ++root) {
    const size_t r = static_cast<size_t>(root);
    if (parts.count[r] == 0) continue;
    // recv is read on the root only; elsewhere this rank's own (smaller) output is passed
    // as a valid pointer that NCCL ignores.
    s = Grouped(api_->Reduce(in + parts.offset[r] * esize, t.output, parts.count[r], plan.dtype,
                             op, root, comm, stream),
                "ncclReduce");
  }
  // Always close the group: NCCL's group depth is per thread and would outlive an error.
  const Status end = communicator.Settle(api_->GroupEnd(), "ncclGroupEnd", stop);
  return s.ok() ? end : s;
}

Status NcclBackend::LaunchAlltoall(Request& c, const ExchangePlan& plan,
                                   Communicator& communicator, Stream stream,
                                   const StopCheck& stop) {
  const char* in = static_cast<const char*>(c.tensors[0].input);
  char* out = static_cast<char*>(c.tensors[0].output);
  Comm comm = communicator.get();
  // Sends and receives must be in one group: outside one, two ranks sending to each other
  // first would each wait for the other's receive.
  KR_RETURN_IF_ERROR(Nccl(api_->GroupStart(), "ncclGroupStart"));
  Status s;
  for (int peer = 0; peer < size_ && s.ok(); ++peer) {
    const size_t p = static_cast<size_t>(peer);
    if (plan.send_bytes[p] > 0) {
      s = Grouped(api_->Send(in + plan.send_offset[p], plan.send_bytes[p], kNcclInt8, peer, comm,
                             stream),
                  "ncclSend");
    }
    if (s.ok() && plan.recv_bytes[p] > 0) {
      s = Grouped(api_->Recv(out + plan.recv_offset[p], plan.recv_bytes[p], kNcclInt8, peer,
                             comm, stream),
                  "ncclRecv");
    }
  }
  const Status end = communicator.Settle(api_->GroupEnd(), "ncclGroupEnd", stop);
  return s.ok() ? end : s;
}

}  // namespace nccl
}  // namespace keras_ring
