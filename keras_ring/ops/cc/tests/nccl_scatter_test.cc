// Reducescatter and alltoall on the NCCL backend, through the runtime with the fake of
// nccl_fake.h: each result is compared with what the host algorithms (RingReduceScatter,
// PairwiseAlltoall) give for the same inputs on the same ranks, bit for bit where the values
// keep every order of reduction exact; and the launches are the planned ones (one
// ncclReduceScatter for equal parts, a group of ncclReduce for uneven ones, a group of
// ncclSend/ncclRecv skipping empty transfers), with no NCCL rule broken on the way.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "../core/reduce.h"
#include "nccl_world.h"
#include "test_harness.h"

namespace kr_test {
namespace {

using keras_ring::DataTypeSize;
using keras_ring::TensorRef;

// Element i of rank r's input: small integers, so sums, products and every order of
// reduction stay exact in every dtype (uint8 gets no negatives).
std::vector<char> Values(DataType t, size_t n, int rank, int seed = 0) {
  std::vector<char> out(n * DataTypeSize(t));
  for (size_t i = 0; i < n; ++i) {
    int v = static_cast<int>((static_cast<size_t>(rank * 7 + seed) + i * 3) % 7) - 3;
    if (t == DataType::kUInt8) v += 3;
    char* p = out.data() + i * DataTypeSize(t);
    const float f = static_cast<float>(v);
    switch (t) {
      case DataType::kFloat16: { uint16_t h = keras_ring::FloatToHalf(f); std::memcpy(p, &h, 2); break; }
      case DataType::kBFloat16: { uint16_t b = keras_ring::FloatToBFloat16(f); std::memcpy(p, &b, 2); break; }
      case DataType::kFloat32: std::memcpy(p, &f, 4); break;
      case DataType::kFloat64: { double d = v; std::memcpy(p, &d, 8); break; }
      case DataType::kInt32: { int32_t x = v; std::memcpy(p, &x, 4); break; }
      case DataType::kInt64: { int64_t x = v; std::memcpy(p, &x, 8); break; }
      case DataType::kInt16:
      case DataType::kUInt16: { int16_t x = static_cast<int16_t>(v); std::memcpy(p, &x, 2); break; }
      default: { int8_t x = static_cast<int8_t>(v); std::memcpy(p, &x, 1); break; }
    }
  }
  return out;
}

Request Reducescatter(DataType t, std::vector<int64_t> shape, const void* in, void* out,
                      ReduceOp op, double pre = 1.0, double post = 1.0) {
  Request r = Allreduce(Tensor(t, std::move(shape), in, out), op, pre, post, "scatter");
  r.kind = Kind::kReducescatter;
  return r;
}

// Rank r's reducescatter output, run on the fake GPU or on the host ring.
std::vector<char> RunScatter(GpuWorld& w, int r, DataType t, int64_t rows, int64_t row_elems,
                             ReduceOp op, bool on_device, double pre = 1.0, double post = 1.0,
                             Status* status = nullptr) {
  const std::vector<char> in = Values(t, static_cast<size_t>(rows * row_elems), r);
  const int64_t mine = keras_ring::ReducescatterRows(rows, w.size())[static_cast<size_t>(r)];
  std::vector<char> out(static_cast<size_t>(mine * row_elems) * DataTypeSize(t), 0x5a);
  Status s = w.Run(r, Reducescatter(t, {rows, row_elems}, in.data(), out.data(), op, pre, post),
                   on_device);
  if (status != nullptr) {
    *status = s;
  } else {
    CHECK_OK(s) << DataTypeName(t) << " rows " << rows << " on rank " << r;
  }
  return out;
}

double Element(DataType t, const std::vector<char>& bytes, size_t i) {
  const char* p = bytes.data() + i * DataTypeSize(t);
  uint16_t h = 0;
  switch (t) {
    case DataType::kFloat16: std::memcpy(&h, p, 2); return keras_ring::HalfToFloat(h);
    case DataType::kBFloat16: std::memcpy(&h, p, 2); return keras_ring::BFloat16ToFloat(h);
    case DataType::kFloat32: { float f; std::memcpy(&f, p, 4); return f; }
    case DataType::kFloat64: { double d; std::memcpy(&d, p, 8); return d; }
    default: return 0.0;
  }
}

int Violations(GpuWorld& w) {
  int n = 0;
  for (int r = 0; r < w.size(); ++r) n += w.fake->Count(r, "violation");
  return n;
}

TEST(NcclScatter_UnevenPartsAreOneGroupOfReducesEvenPartsOneReduceScatter) {
  GpuWorld w(3);
  w.fake->launch_polls = 2;  // nonblocking launches: settled before anything else is queued
  // 7 rows: parts of 3, 2, 2; 2 rows: 1, 1 and an empty part; 6 rows: 2 each.
  for (int64_t rows : {7, 2, 6}) {
    w.Each([&](int r) {
      const auto gpu = RunScatter(w, r, DataType::kFloat32, rows, 3, ReduceOp::kSum, true);
      const auto host = RunScatter(w, r, DataType::kFloat32, rows, 3, ReduceOp::kSum, false);
      CHECK(gpu == host) << "rows " << rows << " rank " << r;
    });
  }
  for (int r = 0; r < 3; ++r) {
    const std::vector<std::string> log = w.fake->Log(r);
    CHECK_EQ(w.fake->Count(r, "reducescatter@"), 1) << "only the 6 rows split evenly";
    CHECK_EQ(w.fake->Count(r, "reduce@"), 3 + 2) << "one per non-empty part";
    CHECK_EQ(w.fake->Count(r, "group start"), 2);
    const int start = Find(log, "group start");
    CHECK_EQ(Find(log, "group end", start) - start, 4) << "three reduces inside one group";
  }
  CHECK_EQ(Violations(w), 0);
}

TEST(NcclScatter_EveryOpAndDtypeNcclReducesEqualsTheHostRing) {
  GpuWorld w(3);
  const DataType types[] = {DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32,
                            DataType::kFloat64, DataType::kInt8,     DataType::kUInt8,
                            DataType::kInt32,   DataType::kInt64};
  const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kAverage, ReduceOp::kMin, ReduceOp::kMax,
                          ReduceOp::kProduct};
  w.Each([&](int r) {
    for (DataType t : types) {
      for (ReduceOp op : ops) {
        for (int64_t rows : {5, 9}) {  // uneven and even over 3 ranks
          const auto gpu = RunScatter(w, r, t, rows, 4, op, true);
          const auto host = RunScatter(w, r, t, rows, 4, op, false);
          CHECK(gpu == host) << DataTypeName(t) << " " << keras_ring::ReduceOpName(op)
                             << " rows " << rows << " rank " << r;
        }
      }
    }
  });
  CHECK_EQ(w.fake->Count(0, "init"), 1);
  CHECK_EQ(Violations(w), 0);
}

TEST(NcclScatter_ScaleFactorsFoldIntoOneCachedPreMulSum) {
  GpuWorld w(3);
  w.Each([&](int r) {
    for (DataType t : {DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32,
                       DataType::kFloat64}) {
      for (int64_t rows : {4, 6}) {
        const auto gpu = RunScatter(w, r, t, rows, 2, ReduceOp::kAverage, true, 0.5, 3.0);
        const auto host = RunScatter(w, r, t, rows, 2, ReduceOp::kAverage, false, 0.5, 3.0);
        const double tol = t == DataType::kBFloat16 ? 1e-2 : t == DataType::kFloat16 ? 2e-3 : 1e-6;
        for (size_t i = 0; i < gpu.size() / DataTypeSize(t); ++i) {
          const double g = Element(t, gpu, i), h = Element(t, host, i);
          CHECK(std::fabs(g - h) <= tol * std::max(1.0, std::fabs(h)))
              << DataTypeName(t) << " rows " << rows << " rank " << r << " i " << i << ": " << g
              << " vs " << h;
        }
      }
    }
  });
  // 0.5 * 3 / 3 ranks: one PreMulSum op per dtype, made once, reused by both row counts.
  CHECK_EQ(w.fake->Count(0, "premul 0.5"), 4);
  CHECK_EQ(w.fake->Count(0, "premul"), 4);
}

TEST(NcclScatter_TypesAndScalesNcclCannotReduceAreRefusedBeforeAnyNcclCall) {
  GpuWorld w(2);
  w.Each([&](int r) {
    Status s;
    RunScatter(w, r, DataType::kInt16, 4, 1, ReduceOp::kSum, true, 1.0, 1.0, &s);
    CHECK(s.code() == Code::kInvalidArgument) << s.message();
    CHECK_CONTAINS(s.message(), "a GPU reducescatter does not support int16 tensors");
    RunScatter(w, r, DataType::kUInt16, 4, 1, ReduceOp::kMax, true, 1.0, 1.0, &s);
    CHECK_CONTAINS(s.message(), "a GPU reducescatter does not support uint16 tensors");
    RunScatter(w, r, DataType::kFloat32, 4, 1, ReduceOp::kMax, true, 2.0, 1.0, &s);
    CHECK(s.code() == Code::kInvalidArgument) << s.message();
    CHECK_CONTAINS(s.message(), "a GPU reducescatter with op");
    RunScatter(w, r, DataType::kInt32, 4, 1, ReduceOp::kSum, true, 2.0, 1.0, &s);
    CHECK(s.code() == Code::kInvalidArgument) << s.message();
    // Empty inputs need no NCCL at all.
    RunScatter(w, r, DataType::kFloat32, 0, 5, ReduceOp::kSum, true);
    RunScatter(w, r, DataType::kFloat32, 3, 0, ReduceOp::kSum, true);
  });
  for (int r = 0; r < 2; ++r) CHECK_EQ(w.fake->Count(r, "init"), 0);
}

struct AlltoallResult {
  std::vector<char> out;
  std::vector<int32_t> received;
  int64_t rows = -1;
  Status status;
};

// Rank r sends splits[q] rows of `row_elems` elements to rank q (no splits: equal parts).
AlltoallResult RunAlltoall(GpuWorld& w, int r, DataType t, std::vector<int64_t> splits,
                           int64_t rows, int64_t row_elems, bool on_device, int seed = 0) {
  AlltoallResult res;
  const std::vector<char> in = Values(t, static_cast<size_t>(rows * row_elems), r, seed);
  res.received.assign(static_cast<size_t>(w.size()), -1);
  Request req;
  req.kind = Kind::kAlltoall;
  req.name = "exchange";
  req.tensors.push_back(Tensor(t, {rows, row_elems}, in.data(), nullptr));
  req.splits = std::move(splits);
  req.received_splits = res.received.data();
  req.allocate_output = [&res, t, row_elems](int64_t total, void** p) {
    res.rows = total;
    res.out.assign(static_cast<size_t>(total * row_elems) * DataTypeSize(t), 0x5a);
    *p = res.out.data();
    return Status::OK();
  };
  res.status = w.Run(r, std::move(req), on_device);
  return res;
}

TEST(NcclAlltoall_UnevenAndEmptySplitsEqualTheHostExchange) {
  GpuWorld w(3);
  w.fake->launch_polls = 2;
  // Rank 1 sends nothing (and has no rows); rank 2 sends rank 2 nothing.
  const std::vector<std::vector<int64_t>> splits = {{2, 0, 1}, {0, 0, 0}, {1, 3, 0}};
  w.Each([&](int r) {
    const auto& mine = splits[static_cast<size_t>(r)];
    const int64_t rows = mine[0] + mine[1] + mine[2];
    for (DataType t : {DataType::kInt64, DataType::kBool, DataType::kFloat16, DataType::kInt16}) {
      const auto gpu = RunAlltoall(w, r, t, mine, rows, 2, true);
      const auto host = RunAlltoall(w, r, t, mine, rows, 2, false);
      CHECK_OK(gpu.status) << DataTypeName(t);
      CHECK_OK(host.status);
      CHECK(gpu.out == host.out) << DataTypeName(t) << " rank " << r;
      CHECK(gpu.received == host.received) << "rank " << r;
      CHECK_EQ(gpu.rows, host.rows);
      std::vector<int32_t> want;  // column r of the splits
      for (const auto& row : splits) want.push_back(static_cast<int32_t>(row[static_cast<size_t>(r)]));
      CHECK(gpu.received == want) << "rank " << r;
    }
  });
  // Per dtype: rank 1 only receives (from rank 2); rank 0 sends to itself and rank 2.
  CHECK_EQ(w.fake->Count(1, "recv@"), 4 * 1) << "rank 1 receives from rank 2 only";
  CHECK_EQ(w.fake->Count(1, "send@"), 0);
  CHECK_EQ(w.fake->Count(0, "send@"), 4 * 2);
  CHECK_EQ(w.fake->Count(0, "recv@"), 4 * 2);
  CHECK_EQ(w.fake->Count(2, "send@"), 4 * 2);
  CHECK_EQ(w.fake->Count(2, "recv@"), 4 * 1);
  CHECK_EQ(Violations(w), 0);
}

TEST(NcclAlltoall_EqualPartsWithoutSplitsAndNothingToMove) {
  GpuWorld w(3);
  w.Each([&](int r) {
    const auto gpu = RunAlltoall(w, r, DataType::kFloat32, {}, 6, 5, true);
    const auto host = RunAlltoall(w, r, DataType::kFloat32, {}, 6, 5, false);
    CHECK_OK(gpu.status);
    CHECK(gpu.out == host.out && gpu.received == std::vector<int32_t>({2, 2, 2})) << "rank " << r;
    // No rows anywhere: an empty output and zero splits, without NCCL.
    const auto empty = RunAlltoall(w, r, DataType::kFloat32, {0, 0, 0}, 0, 5, true);
    CHECK_OK(empty.status);
    CHECK_EQ(empty.rows, 0);
    CHECK(empty.received == std::vector<int32_t>({0, 0, 0}));
  });
  CHECK_EQ(w.fake->Count(0, "group start"), 1);
  CHECK_EQ(Violations(w), 0);
}

TEST(NcclAlltoall_BadSplitsOnOneRankFailEveryRankBeforeAnyNcclCall) {
  GpuWorld w(3);
  w.Each([&](int r) {
    // Rank 1's splits add up to 3 of its 4 rows.
    const std::vector<int64_t> splits = r == 1 ? std::vector<int64_t>{1, 1, 1}
                                               : std::vector<int64_t>{2, 1, 1};
    const auto bad = RunAlltoall(w, r, DataType::kFloat32, splits, 4, 2, true);
    CHECK(bad.status.code() == Code::kInvalidArgument) << bad.status.message();
    CHECK_CONTAINS(bad.status.message(), "rank 1 passed splits [1, 1, 1] for a tensor of 4 rows");
    CHECK_EQ(bad.status.peer(), 1);
    CHECK_EQ(bad.rows, -1) << "no output was allocated";
    // Rows that do not split evenly without splits: refused alike, naming the rank.
    const auto uneven = RunAlltoall(w, r, DataType::kFloat32, {}, r == 2 ? 4 : 3, 2, true);
    CHECK_CONTAINS(uneven.status.message(), "rank 2 has 4 rows, which do not split evenly");
    // The runtime stays usable.
    const auto good = RunAlltoall(w, r, DataType::kFloat32, {1, 1, 1}, 3, 2, true);
    CHECK_OK(good.status);
  });
  for (int r = 0; r < 3; ++r) CHECK_EQ(w.fake->Count(r, "init"), 1) << "for the good one only";
}

TEST(NcclFake_PointToPointPairsByPeerAndFlagsUngroupedCalls) {
  // The fake itself: sends and receives pair by (from, to) in order across launches, and a
  // send outside a group (which deadlocks when two ranks send to each other) is a violation.
  auto world = std::make_shared<FakeNcclWorld>(2);
  FakeDeviceApi a(world, 0), b(world, 1);
  kn::UniqueId id{};
  std::strcpy(id.internal, "p2p");
  kn::Comm ca = nullptr, cb = nullptr;
  a.CommInitRank(&ca, 2, id, 0);
  b.CommInitRank(&cb, 2, id, 1);
  int32_t x = 7, y = 0, z = 9, u = 0;
  a.GroupStart();
  a.Send(&x, 4, kn::kNcclInt8, 1, ca, CallerStream(0));
  a.Recv(&u, 4, kn::kNcclInt8, 1, ca, CallerStream(0));
  a.GroupEnd();
  b.Send(&z, 4, kn::kNcclInt8, 0, cb, CallerStream(1));
  b.Recv(&y, 4, kn::kNcclInt8, 0, cb, CallerStream(1));
  CHECK_EQ(y, 7);
  CHECK_EQ(u, 9);
  CHECK_EQ(world->Count(0, "violation"), 0);
  CHECK_EQ(world->Count(1, "violation: ungrouped send"), 1);
  CHECK_EQ(world->Count(1, "violation: ungrouped recv"), 1);
}

}  // namespace
}  // namespace kr_test
