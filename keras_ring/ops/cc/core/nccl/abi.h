// The few CUDA runtime and NCCL types and constants the GPU backend uses, re-declared from
// their documented C ABI so that the library builds without CUDA or NCCL headers and one
// build serves machines with and without GPUs. Handles are opaque pointers, enums travel as
// int, and ncclUniqueId is a 128-byte struct passed by value, exactly as in nccl.h.
#pragma once

#include <climits>
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
constexpr int kNcclInProgress = 7;  // a nonblocking communicator's operation still runs
constexpr int kNcclTimeout = 8;     // NCCL >= 2.30: an operation ran past NCCL's own timeout

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

// ncclConfig_t as NCCL 2.14 introduced it: a versioned, append-only struct whose first fields
// never move. NCCL >= 2.17 copies min(size, its own sizeof) bytes over its defaults and then
// resets every field newer than `version` to its default; 2.14 to 2.16 read `blocking` alone.
// So this prefix (size 20: no trailing padding is passed) with version 2.14.0 means exactly
// "blocking as given, everything else NCCL's default" to every NCCL that has the function.
struct NcclConfig {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
};
constexpr size_t kNcclConfigBytes = 20;  // offsetof(blocking) + sizeof(int)
constexpr unsigned int kNcclConfigMagic = 0xcafebeef;  // NCCL_API_MAGIC
constexpr unsigned int kNcclConfigVersion = 21400;    // NCCL_VERSION(2, 14, 0)
constexpr int kNcclConfigUndefined = INT_MIN;         // NCCL_CONFIG_UNDEF_INT
static_assert(offsetof(NcclConfig, magic) == 8 && offsetof(NcclConfig, version) == 12 &&
                  offsetof(NcclConfig, blocking) == 16,
              "ncclConfig_t's leading fields");
static_assert(offsetof(NcclConfig, blocking) + sizeof(int) == kNcclConfigBytes,
              "the size passed covers exactly the fields set");

// A config for a communicator whose calls return at once (ncclInProgress while they run),
// the only kind NCCL can abort safely.
inline NcclConfig NonblockingConfig() {
  return NcclConfig{kNcclConfigBytes, kNcclConfigMagic, kNcclConfigVersion, 0};
}

// The oldest NCCL with everything used here: ncclAvg and bfloat16 (2.10),
// ncclRedOpCreatePreMulSum (2.11). Every nvidia-nccl-cu12 wheel is newer. Nonblocking,
// abortable communicators need 2.14 (ncclCommInitRankConfig, ncclCommFinalize); older ones
// get blocking communicators, whose setup and teardown no deadline can bound.
constexpr int kMinNcclVersion = 21200;
constexpr int kNonblockingNcclVersion = 21400;

// ncclGetVersion's code as "2.19.3" (codes below 2.9 use a different encoding).
std::string NcclVersionString(int code);

}  // namespace nccl
}  // namespace keras_ring
