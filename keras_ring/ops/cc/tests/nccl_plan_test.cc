// The GPU backend's pure logic: NCCL types, folding of scale factors, allgather layouts,
// result codes as statuses, version strings, and the loader's message when NCCL is missing.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../core/nccl/device_api.h"
#include "../core/nccl/device_c_api.h"
#include "../core/nccl/plan.h"
#include "../core/reduce.h"
#include "test_harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

namespace kn = keras_ring::nccl;
using keras_ring::Code;
using keras_ring::DataType;
using keras_ring::ReduceOp;
using keras_ring::Signature;
using keras_ring::Status;

TEST(NcclPlan_DataTypes) {
  const std::vector<std::pair<DataType, int>> expected = {
      {DataType::kFloat16, kn::kNcclFloat16}, {DataType::kBFloat16, kn::kNcclBfloat16},
      {DataType::kFloat32, kn::kNcclFloat32}, {DataType::kFloat64, kn::kNcclFloat64},
      {DataType::kInt8, kn::kNcclInt8},       {DataType::kUInt8, kn::kNcclUint8},
      {DataType::kInt32, kn::kNcclInt32},     {DataType::kInt64, kn::kNcclInt64}};
  for (const auto& e : expected) {
    int t = -1;
    CHECK_OK(kn::NcclReduceType(e.first, &t));
    CHECK_EQ(t, e.second) << keras_ring::DataTypeName(e.first);
  }
  int t = -1;
  const Status s = kn::NcclReduceType(DataType::kBool, &t);
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK_CONTAINS(s.message(), "bool");
}

kn::ReducePlan Plan(DataType t, ReduceOp op, double pre, double post, int size, Status* s) {
  kn::ReducePlan plan;
  *s = kn::PlanReduce(t, op, pre, post, size, &plan);
  return plan;
}

TEST(NcclPlan_ScaleFactorsFoldIntoOnePreMultiplication) {
  Status s;
  kn::ReducePlan p = Plan(DataType::kFloat32, ReduceOp::kSum, 1, 1, 4, &s);
  CHECK(s.ok() && p.op == kn::kNcclSum && !p.premul);
  p = Plan(DataType::kFloat32, ReduceOp::kAverage, 1, 1, 4, &s);
  CHECK(s.ok() && p.op == kn::kNcclAvg && !p.premul);
  // gradient_predivide_factor: prescale 1/f, postscale f is a plain Average.
  p = Plan(DataType::kFloat16, ReduceOp::kAverage, 0.25, 4, 4, &s);
  CHECK(s.ok() && p.op == kn::kNcclAvg && !p.premul);
  p = Plan(DataType::kFloat64, ReduceOp::kSum, 2, 3, 4, &s);
  CHECK(s.ok() && p.premul) << s.message();
  CHECK_EQ(p.scalar, 6.0);
  p = Plan(DataType::kBFloat16, ReduceOp::kAverage, 2, 3, 4, &s);
  CHECK(s.ok() && p.premul);
  CHECK_EQ(p.scalar, 1.5);
  CHECK_EQ(p.dtype, kn::kNcclBfloat16);
  p = Plan(DataType::kInt32, ReduceOp::kAverage, 1, 1, 3, &s);
  CHECK(s.ok() && p.op == kn::kNcclAvg && !p.premul);
  p = Plan(DataType::kUInt8, ReduceOp::kMax, 1, 1, 3, &s);
  CHECK(s.ok() && p.op == kn::kNcclMax);
  p = Plan(DataType::kFloat32, ReduceOp::kProduct, 1, 1, 3, &s);
  CHECK(s.ok() && p.op == kn::kNcclProd);
  p = Plan(DataType::kInt8, ReduceOp::kMin, 1, 1, 3, &s);
  CHECK(s.ok() && p.op == kn::kNcclMin);
}

TEST(NcclPlan_ScalesNcclCannotApplyAreRefused) {
  Status s;
  Plan(DataType::kFloat32, ReduceOp::kMax, 2, 1, 4, &s);
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK_CONTAINS(s.message(), "op Max on float32 and prescale_factor=2.0");
  CHECK_CONTAINS(s.message(), "place this allreduce on the CPU");
  Plan(DataType::kFloat32, ReduceOp::kProduct, 0.5, 2, 4, &s);  // not linear: 2^n != 2
  CHECK(s.code() == Code::kInvalidArgument);
  Plan(DataType::kInt32, ReduceOp::kSum, 1, 0.5, 4, &s);  // an integer has no 0.5
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK_CONTAINS(s.message(), "int32");
  CHECK(!s.fatal());
  // Factors whose product is 1 are not a plain sum for integers: trunc(1 * 0.5) * 2 is 0.
  Plan(DataType::kInt64, ReduceOp::kSum, 0.5, 2, 4, &s);
  CHECK(s.code() == Code::kInvalidArgument) << s.message();
  Plan(DataType::kInt8, ReduceOp::kAverage, 2, 0.5, 4, &s);
  CHECK(s.code() == Code::kInvalidArgument) << s.message();
}

TEST(NcclPlan_ScalarIsEncodedInTheDataType) {
  uint64_t bits = kn::EncodeScalar(DataType::kFloat16, 0.5);
  CHECK_EQ(bits, uint64_t{0x3800});
  bits = kn::EncodeScalar(DataType::kBFloat16, 1.5);
  CHECK_EQ(bits, uint64_t{0x3FC0});
  bits = kn::EncodeScalar(DataType::kFloat32, 0.25);
  float f = 0;
  std::memcpy(&f, &bits, sizeof f);
  CHECK_EQ(f, 0.25f);
  bits = kn::EncodeScalar(DataType::kFloat64, 1.0 / 3);
  double d = 0;
  std::memcpy(&d, &bits, sizeof d);
  CHECK_EQ(d, 1.0 / 3);
}

Signature Rows(int64_t rows, int64_t row_elems) {
  Signature s;
  s.count = rows;
  s.row_elems = row_elems;
  return s;
}

TEST(NcclPlan_AllgatherLayout) {
  kn::GatherPlan g = kn::PlanGather({Rows(2, 4), Rows(0, 4), Rows(3, 4)}, 4);
  CHECK(!g.uniform);
  CHECK(g.offset == std::vector<size_t>({0, 32, 32}));
  CHECK(g.bytes == std::vector<size_t>({32, 0, 48}));
  CHECK_EQ(g.total, size_t{80});
  g = kn::PlanGather({Rows(5, 1), Rows(5, 1)}, 2);
  CHECK(g.uniform);
  CHECK_EQ(g.total, size_t{20});
}

TEST(NcclPlan_OneRankKernelLeavesATailWhereTheShareRoundsDown) {
  // What NCCL 2.28.9 did on an H200: the last 7 of 2^20 + 7 elements left unwritten.
  CHECK_EQ(kn::OneRankKernelWrites((1 << 20) + 7, 4), size_t{1 << 20});
  CHECK_EQ(kn::OneRankKernelWrites((1 << 20) + 7, 8), size_t{1 << 20});
  CHECK_EQ(kn::OneRankKernelWrites((1 << 20) + 7, 2), size_t{1 << 20});
  CHECK_EQ(kn::OneRankKernelWrites(1 << 20, 4), size_t{1 << 20});
  CHECK_EQ(kn::OneRankKernelWrites(1000, 4), size_t{1000});  // one block writes everything
  CHECK_EQ(kn::OneRankKernelWrites(0, 4), size_t{0});
}

TEST(NcclPlan_OneRankPiecesAreWrittenWholeAndCoverTheTensorOnce) {
  size_t split = 0;
  for (size_t esize : {size_t{1}, size_t{2}, size_t{4}, size_t{8}}) {
    for (size_t count = 0; count < (size_t{3} << 20) / esize; count += count < 70000 ? 1 : 997) {
      const std::vector<size_t> pieces = kn::OneRankPieces(count, esize);
      size_t total = 0;
      for (size_t piece : pieces) {
        if (kn::OneRankKernelWrites(piece, esize) != piece) {
          CHECK_EQ(kn::OneRankKernelWrites(piece, esize), piece)
              << "piece " << piece << " of " << count << " x " << esize << " B";
          return;
        }
        total += piece;
      }
      if (total != count || pieces.size() > 2) {
        CHECK_EQ(total, count) << pieces.size() << " pieces of " << count << " x " << esize;
        return;
      }
      split += pieces.size() == 2 ? 1 : 0;
    }
  }
  CHECK(split > 1000) << "the tail case was exercised " << split << " times";
}

TEST(NcclPlan_ResultCodesBecomeStatuses) {
  Status s = kn::NcclError(kn::kNcclRemoteError, "ncclAllReduce", "remote process exited");
  CHECK(s.code() == Code::kUnavailable && s.fatal());
  CHECK_CONTAINS(s.message(), "ncclAllReduce failed: remote process exited");
  CHECK_CONTAINS(s.message(), "a peer process or the network");
  CHECK_CONTAINS(s.message(), "NCCL_DEBUG=WARN");
  s = kn::NcclError(kn::kNcclSystemError, "ncclCommInitRank", "system error");
  CHECK(s.code() == Code::kUnavailable);
  s = kn::NcclError(kn::kNcclInvalidUsage, "ncclCommInitRank", "invalid usage");
  CHECK(s.code() == Code::kInternal && s.fatal());
  CHECK_CONTAINS(s.message(), "NCCL_MULTI_RANK_GPU_ENABLE=1");
  s = kn::NcclError(kn::kNcclUnhandledCudaError, "ncclBroadcast", "unhandled cuda error");
  CHECK(s.code() == Code::kInternal);
  CHECK(s.message().find("MULTI_RANK") == std::string::npos);
  // NCCL 2.30's own timeout is a timeout here too.
  s = kn::NcclError(kn::kNcclTimeout, "ncclAllReduce", "operation timed out");
  CHECK(s.code() == Code::kDeadlineExceeded && s.fatal());
  CHECK_CONTAINS(s.message(), "(ncclResult_t 8)");
  s = kn::CudaError(700, "cudaEventQuery", "an illegal memory access was encountered");
  CHECK(s.code() == Code::kInternal && s.fatal());
  CHECK_CONTAINS(s.message(), "cudaEventQuery failed: an illegal memory access");
}

// The config handed to ncclCommInitRankConfig, against nccl.h: ncclResult_t's values, and
// the leading fields of ncclConfig_t and NCCL_CONFIG_INITIALIZER's size, magic and version.
TEST(NcclPlan_ConfigAbiIsNcclsFirstFields) {
  CHECK_EQ(kn::kNcclInProgress, 7);
  CHECK_EQ(kn::kNcclTimeout, 8);
  const kn::NcclConfig c = kn::NonblockingConfig();
  unsigned char bytes[sizeof c];
  std::memcpy(bytes, &c, sizeof c);
  size_t size = 0;
  unsigned int magic = 0, version = 0;
  int blocking = -1;
  std::memcpy(&size, bytes + 0, sizeof size);  // size_t size
  std::memcpy(&magic, bytes + 8, 4);           // unsigned int magic
  std::memcpy(&version, bytes + 12, 4);        // unsigned int version
  std::memcpy(&blocking, bytes + 16, 4);       // int blocking
  CHECK_EQ(size, size_t{20}) << "NCCL copies `size` bytes: exactly the fields set here";
  CHECK_EQ(magic, 0xcafebeefu);
  CHECK_EQ(version, 21400u) << "NCCL resets fields newer than `version` to their defaults";
  CHECK_EQ(blocking, 0);
  CHECK_EQ(kn::kNcclConfigUndefined, INT32_MIN);
  CHECK_EQ(kn::kNonblockingNcclVersion, 21400);
}

TEST(NcclPlan_VersionStrings) {
  CHECK_EQ(kn::NcclVersionString(21903), std::string("2.19.3"));
  CHECK_EQ(kn::NcclVersionString(23004), std::string("2.30.4"));
  CHECK_EQ(kn::NcclVersionString(2708), std::string("2.7.8"));
  CHECK_EQ(kn::NcclVersionString(kn::kMinNcclVersion), std::string("2.12.0"));
}

// The real loader on a machine without NCCL (CI): the message says what is missing and how
// to install it. Skipped where NCCL is installed.
TEST(NcclLoader_MissingNcclSaysWhatToInstall) {
  char err[2048] = {};
  int version = -1;
  const int rc = keras_ring_nccl_probe("/nonexistent/keras_ring_test", &version, err, sizeof err);
  if (rc == 0) {
    CHECK(version >= kn::kMinNcclVersion);
    return;
  }
  const std::string msg = err;
  CHECK_EQ(rc, static_cast<int>(Code::kFailedPrecondition));
  CHECK_CONTAINS(msg, "keras_ring: GPU collective needs NCCL: libnccl.so.2 not found");
  CHECK_CONTAINS(msg, "install keras-ring[cuda] or nvidia-nccl-cu12");
  CHECK_CONTAINS(msg, "/nonexistent/keras_ring_test");
  CHECK_EQ(version, 0);
}

}  // namespace
}  // namespace kr_test
