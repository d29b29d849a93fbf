#include "plan.h"

#include <algorithm>
#include <cstring>

#include "../reduce.h"
#include "../request.h"

namespace keras_ring {
namespace nccl {

namespace {

bool IsFloat(DataType t) {
  return t == DataType::kFloat16 || t == DataType::kBFloat16 || t == DataType::kFloat32 ||
         t == DataType::kFloat64;
}

std::string Factor(double f) {
  std::string s = std::to_string(f);
  while (s.size() > 1 && s.back() == '0' && s[s.size() - 2] != '.') s.pop_back();
  return s;
}

}  // namespace

Status NcclReduceType(DataType dtype, int* nccl_type, const char* collective) {
  switch (dtype) {
    case DataType::kFloat16: *nccl_type = kNcclFloat16; return Status::OK();
    case DataType::kBFloat16: *nccl_type = kNcclBfloat16; return Status::OK();
    case DataType::kFloat32: *nccl_type = kNcclFloat32; return Status::OK();
    case DataType::kFloat64: *nccl_type = kNcclFloat64; return Status::OK();
    case DataType::kInt8: *nccl_type = kNcclInt8; return Status::OK();
    case DataType::kUInt8: *nccl_type = kNcclUint8; return Status::OK();
    case DataType::kInt32: *nccl_type = kNcclInt32; return Status::OK();
    case DataType::kInt64: *nccl_type = kNcclInt64; return Status::OK();
    case DataType::kBool:
    case DataType::kInt16:   // NCCL has no 16-bit integers: TensorFlow places these
    case DataType::kUInt16:  // collectives on the CPU (the GPU kernels do not take them)
      break;
  }
  return Status(Code::kInvalidArgument,
                std::string("a GPU ") + collective + " does not support " + DataTypeName(dtype) +
                    " tensors: NCCL has no such reduction type (place it on the CPU)");
}

Status PlanReduce(DataType dtype, ReduceOp op, double prescale, double postscale, int size,
                  ReducePlan* plan, const char* collective) {
  KR_RETURN_IF_ERROR(NcclReduceType(dtype, &plan->dtype, collective));
  plan->premul = false;
  plan->scalar = 1.0;
  const bool unscaled = prescale == 1.0 && postscale == 1.0;
  double factor = prescale * postscale;
  switch (op) {
    case ReduceOp::kSum: plan->op = kNcclSum; break;
    case ReduceOp::kAverage: plan->op = kNcclAvg; break;
    case ReduceOp::kMin: plan->op = kNcclMin; break;
    case ReduceOp::kMax: plan->op = kNcclMax; break;
    case ReduceOp::kProduct: plan->op = kNcclProd; break;
  }
  const bool linear = op == ReduceOp::kSum || op == ReduceOp::kAverage;
  // Folding pre and post into one factor is exact for floats only: integers truncate after
  // each scaling (0.5 then 2 turns 1 into 0), so only an unscaled integer plan runs on NCCL.
  if (unscaled || (linear && factor == 1.0 && IsFloat(dtype))) return Status::OK();
  if (!linear || !IsFloat(dtype)) {
    return Status(Code::kInvalidArgument,
                  std::string("a GPU ") + collective + " with op " + ReduceOpName(op) + " on " +
                      DataTypeName(dtype) + " and prescale_factor=" + Factor(prescale) +
                      ", postscale_factor=" + Factor(postscale) +
                      " is not supported: NCCL can fold scale factors only into Sum and "
                      "Average of floating-point tensors; scale the tensor outside the "
                      "collective, or place this " + collective + " on the CPU");
  }
  if (op == ReduceOp::kAverage) factor /= static_cast<double>(size);
  plan->premul = true;
  plan->scalar = factor;
  return Status::OK();
}

namespace {
constexpr size_t kOneRankBlockBytes = 16 << 10;  // NCCL's bytes per block of that kernel
constexpr size_t kOneRankMaxBlocks = 32;
constexpr size_t kOneRankPackBytes = 16;
}  // namespace

size_t OneRankKernelWrites(size_t count, size_t element_bytes) {
  const size_t bytes = count * element_bytes;
  const size_t blocks =
      std::min(kOneRankMaxBlocks, (bytes + kOneRankBlockBytes - 1) / kOneRankBlockBytes);
  if (blocks == 0) return count;
  const size_t pack = std::max<size_t>(1, kOneRankPackBytes / element_bytes);
  const size_t share = (count / blocks + pack - 1) / pack * pack;
  return std::min(count, blocks * share);
}

std::vector<size_t> OneRankPieces(size_t count, size_t element_bytes) {
  if (element_bytes == 0 || OneRankKernelWrites(count, element_bytes) == count) return {count};
  const size_t bulk = count * element_bytes / kOneRankBlockBytes * kOneRankBlockBytes /
                      element_bytes;
  return {bulk, count - bulk};
}

uint64_t EncodeScalar(DataType dtype, double value) {
  uint64_t bits = 0;
  switch (dtype) {
    case DataType::kFloat16: {
      const uint16_t h = FloatToHalf(static_cast<float>(value));
      std::memcpy(&bits, &h, sizeof h);
      break;
    }
    case DataType::kBFloat16: {
      const uint16_t b = FloatToBFloat16(static_cast<float>(value));
      std::memcpy(&bits, &b, sizeof b);
      break;
    }
    case DataType::kFloat32: {
      const float f = static_cast<float>(value);
      std::memcpy(&bits, &f, sizeof f);
      break;
    }
    default:
      std::memcpy(&bits, &value, sizeof value);
      break;
  }
  return bits;
}

GatherPlan PlanGather(const std::vector<Signature>& sigs, size_t element_bytes) {
  GatherPlan plan;
  plan.uniform = true;
  for (const Signature& s : sigs) {
    const size_t bytes = static_cast<size_t>(s.count * s.row_elems) * element_bytes;
    plan.offset.push_back(plan.total);
    plan.bytes.push_back(bytes);
    plan.total += bytes;
    plan.uniform = plan.uniform && bytes == plan.bytes.front();
  }
  return plan;
}

ScatterPlan PlanScatter(int64_t rows, int64_t row_elems, int size) {
  ScatterPlan plan;
  plan.uniform = rows % size == 0;
  size_t offset = 0;
  for (int64_t r : ReducescatterRows(rows, size)) {
    plan.offset.push_back(offset);
    plan.count.push_back(static_cast<size_t>(r * row_elems));
    offset += plan.count.back();
  }
  return plan;
}

ExchangePlan PlanExchange(const std::vector<std::vector<int64_t>>& splits, int rank,
                          size_t row_bytes) {
  ExchangePlan plan;
  const size_t me = static_cast<size_t>(rank);
  size_t sent = 0, received = 0;
  for (size_t p = 0; p < splits.size(); ++p) {
    plan.send_offset.push_back(sent);
    plan.send_bytes.push_back(static_cast<size_t>(splits[me][p]) * row_bytes);
    sent += plan.send_bytes.back();
    plan.recv_offset.push_back(received);
    plan.recv_bytes.push_back(static_cast<size_t>(splits[p][me]) * row_bytes);
    received += plan.recv_bytes.back();
    plan.recv_rows.push_back(static_cast<int32_t>(splits[p][me]));
    plan.total_rows += splits[p][me];
  }
  return plan;
}

Status NcclError(int result, const std::string& call, const std::string& text) {
  std::string msg = call + " failed: " + text + " (ncclResult_t " + std::to_string(result) + ")";
  Code code = Code::kInternal;
  switch (result) {
    case kNcclTimeout:  // NCCL >= 2.30 gave up by itself
      code = Code::kDeadlineExceeded;
      msg += "; NCCL's own timeout expired: a peer may have stalled or died";
      break;
    case kNcclSystemError:
    case kNcclRemoteError:
      code = Code::kUnavailable;
      msg += "; a peer process or the network between the ranks failed";
      break;
    case kNcclInvalidUsage:
      if (call.compare(0, 16, "ncclCommInitRank") == 0) {  // with or without Config
        msg += "; if two ranks share one GPU: that needs NCCL >= 2.30 with "
               "NCCL_MULTI_RANK_GPU_ENABLE=1 (keras_ring.init() pins each rank to the GPU of "
               "its local_rank)";
      }
      break;
    default:
      break;
  }
  return Status(code, msg + "; NCCL_DEBUG=WARN prints NCCL's own report");
}

Status CudaError(int error, const std::string& call, const std::string& text) {
  return Status(Code::kInternal,
                call + " failed: " + text + " (cudaError_t " + std::to_string(error) + ")");
}

}  // namespace nccl
}  // namespace keras_ring
