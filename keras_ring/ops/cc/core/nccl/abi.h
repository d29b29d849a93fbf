// The few CUDA runtime and NCCL types and constants the GPU backend uses, re-declared from
// their documented C ABI so that the library builds without CUDA or NCCL headers and one
// build serves machines with and without GPUs. Handles are opaque pointers, enums travel as
// int, and ncclUniqueId is a 128-byte struct passed by value, exactly as in nccl.h.
#pragma once

#include <cstddef>
#include <string>

namespace keras_ring {
namespace nccl {

using Stream = void*;  // cudaStream_t (nullptr is the legacy default stream)
using Event = void*;   // cudaEvent_t
struct CommObject;     // struct ncclComm, never dereferenced here
using Comm = CommObject*;  // ncclComm_t

constexpr size_t kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
struct UniqueId {
  char internal[kUniqueIdBytes];
};
static_assert(sizeof(UniqueId) == kUniqueIdBytes, "ncclUniqueId is 128 bytes");

// cudaError_t values the backend tells apart, and the flags it passes.
constexpr int kCudaSuccess = 0;
constexpr int kCudaErrorNotReady = 600;
constexpr unsigned kCudaStreamNonBlocking = 0x01;
constexpr unsigned kCudaEventDisableTiming = 0x02;

// ncclResult_t
constexpr int kNcclSuccess = 0;
constexpr int kNcclUnhandledCudaError = 1;
constexpr int kNcclSystemError = 2;
constexpr int kNcclInternalError = 3;
constexpr int kNcclInvalidArgument = 4;
constexpr int kNcclInvalidUsage = 5;
constexpr int kNcclRemoteError = 6;
constexpr int kNcclInProgress = 7;

// ncclDataType_t
constexpr int kNcclInt8 = 0;
constexpr int kNcclUint8 = 1;
constexpr int kNcclInt32 = 2;
constexpr int kNcclInt64 = 4;
constexpr int kNcclFloat16 = 6;
constexpr int kNcclFloat32 = 7;
constexpr int kNcclFloat64 = 8;
constexpr int kNcclBfloat16 = 9;

// ncclRedOp_t built-ins; ncclRedOpCreatePreMulSum hands out further values.
constexpr int kNcclSum = 0;
constexpr int kNcclProd = 1;
constexpr int kNcclMax = 2;
constexpr int kNcclMin = 3;
constexpr int kNcclAvg = 4;

// ncclScalarResidence_t: the PreMulSum scalar is read from host memory when the op is made.
constexpr int kNcclScalarHostImmediate = 1;

// The oldest NCCL with everything used here: ncclAvg and bfloat16 (2.10),
// ncclRedOpCreatePreMulSum (2.11). Every nvidia-nccl-cu12 wheel is newer.
constexpr int kMinNcclVersion = 21200;

// ncclGetVersion's code as "2.19.3" (codes below 2.9 use a different encoding).
std::string NcclVersionString(int code);

}  // namespace nccl
}  // namespace keras_ring
