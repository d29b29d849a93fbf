// How keras_ring's collectives map onto NCCL: data types, reduce ops with their scale
// factors, allgather layouts, and NCCL/CUDA result codes as statuses. Pure functions, so
// the C++ tests cover them without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../common.h"
#include "../signature.h"
#include "abi.h"

namespace keras_ring {
namespace nccl {

// One allreduce in NCCL's terms.
struct ReducePlan {
  int dtype = kNcclFloat32;
  int op = kNcclSum;     // a built-in ncclRedOp_t, used unless `premul`
  bool premul = false;   // an op from ncclRedOpCreatePreMulSum: the sum of scalar * x
  double scalar = 1.0;
};

// The NCCL type of `dtype` in a reduction (bool has none). `collective` names the refused
// collective in the error.
Status NcclReduceType(DataType dtype, int* nccl_type, const char* collective = "allreduce");

// NCCL has no post-scaling and no device kernels can be launched here, so scale factors are
// folded into one pre-multiplication: postscale * reduce(prescale * x) equals
// sum(prescale * postscale * x) for Sum, and with 1/size more for Average. Both factors equal
// to 1 map to ncclSum / ncclAvg (which for integers divides exactly, truncating toward zero,
// as the host path does). Min, Max and Product are not linear, and integers cannot carry a
// fractional factor: with factors other than 1 those are InvalidArgument (on every rank alike,
// since the factors are part of the checked signature).
Status PlanReduce(DataType dtype, ReduceOp op, double prescale, double postscale, int size,
                  ReducePlan* plan, const char* collective = "allreduce");

// A reduction on a one-rank communicator is not communication: NCCL runs it as one kernel
// (ncclLaunchOneRank) on min(32, ceil(bytes / 16 KiB)) blocks that each take
// alignUp(floor(count / blocks), 16 bytes) elements, and nothing writes what that leaves over:
// up to 31 trailing elements, for example the last 7 of a 2^20 + 7 float32 Average, which
// stay unwritten (out of place) or unscaled (in place). Seen with NCCL 2.28.3 and 2.28.9 on an
// H200, for every scaled reduction (PreMulSum, and Average of floats). The elements that
// kernel writes of `count` (this model matched NCCL 2.28.9 at 180 of 180 lengths there):
size_t OneRankKernelWrites(size_t count, size_t element_bytes);
// The element counts of consecutive, disjoint calls that make up one such reduction, each
// written whole by that kernel and by any correct one: a bulk of whole 16 KiB (every block
// then gets the same aligned share) and a tail under 16 KiB (one block). One count where
// the kernel already writes everything.
std::vector<size_t> OneRankPieces(size_t count, size_t element_bytes);

// The PreMulSum scalar as one element of `dtype` in the low bytes (NCCL reads the scalar in
// the data's own type).
uint64_t EncodeScalar(DataType dtype, double value);

// Allgather of blocks that may differ in size: where each rank's block goes in the output.
struct GatherPlan {
  std::vector<size_t> offset;  // bytes, per rank
  std::vector<size_t> bytes;   // per rank
  size_t total = 0;
  bool uniform = false;  // all blocks equal: one ncclAllGather; else a group of broadcasts
};
GatherPlan PlanGather(const std::vector<Signature>& sigs, size_t element_bytes);

// Reducescatter: each rank's part of the input in elements (rows split as Horovod does, the
// first rows % size ranks one row more). Equal parts are one ncclReduceScatter; uneven ones a
// group of ncclReduce, one per non-empty part with its owner as root (see scatter.cc).
struct ScatterPlan {
  std::vector<size_t> offset;  // elements, per rank
  std::vector<size_t> count;   // elements, per rank
  bool uniform = false;
};
ScatterPlan PlanScatter(int64_t rows, int64_t row_elems, int size);

// Alltoall, from every rank's agreed splits (splits[p][q]: rows rank p sends to rank q):
// what this rank sends to and receives from each peer, in bytes and at which offsets.
struct ExchangePlan {
  std::vector<size_t> send_offset, send_bytes;  // per peer, into the input
  std::vector<size_t> recv_offset, recv_bytes;  // per peer, into the output
  std::vector<int32_t> recv_rows;               // per peer: received_splits
  int64_t total_rows = 0;                       // rows of the output
};
ExchangePlan PlanExchange(const std::vector<std::vector<int64_t>>& splits, int rank,
                          size_t row_bytes);

// An NCCL / CUDA result as a status. `call` names the function, `text` is the library's own
// description. Errors after which the communicator cannot be trusted are fatal statuses.
Status NcclError(int result, const std::string& call, const std::string& text);
Status CudaError(int error, const std::string& call, const std::string& text);

}  // namespace nccl
}  // namespace keras_ring
