// The fast agreement and the size-aware allreduce over the local transport, through the
// HostExecutor as the runtime drives it: every world size 1-9, every dtype and op on each
// path (data riding the agreement, recursive doubling, ring), mismatches at every rank
// position, and the stall report's "not heard from" sets.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../core/doubling.h"
#include "../core/fast_agree.h"
#include "../core/host_executor.h"
#include "../core/reduce.h"
#include "test_harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using keras_ring::AlgoConfig;
using keras_ring::Code;
using keras_ring::DataType;
using keras_ring::DataTypeSize;
using keras_ring::ExecutionStats;
using keras_ring::HostExecutor;
using keras_ring::Kind;
using keras_ring::ReduceOp;
using keras_ring::Request;
using keras_ring::Status;
using keras_ring::Transport;

AlgoConfig Config(bool fast) {
  AlgoConfig cfg;
  cfg.timeout_seconds = 5.0;  // per wait: a bug fails fast instead of hanging
  cfg.segment_bytes = 4096;   // large vectors cross segments
  cfg.fast_agree = fast;
  cfg.doubling_max_bytes = 128 << 10;  // above the ride limit: all three paths are taken
  return cfg;
}

// Small integers: every sum, product, min and max is exact in every dtype (f16 included),
// whatever the order of combination, so each path must give exactly the expected bits.
// Non-negative for the unsigned dtype.
double Input(int rank, size_t i, ReduceOp op) {
  const uint64_t h = Mix(static_cast<uint64_t>(rank), i);
  if (op == ReduceOp::kProduct) return static_cast<double>(h % 2 + 1);
  return static_cast<double>(h % 7);
}

double Expected(int n, size_t i, ReduceOp op) {
  double acc = Input(0, i, op);
  for (int r = 1; r < n; ++r) {
    const double v = Input(r, i, op);
    if (op == ReduceOp::kMin) acc = std::min(acc, v);
    else if (op == ReduceOp::kMax) acc = std::max(acc, v);
    else if (op == ReduceOp::kProduct) acc *= v;
    else acc += v;
  }
  if (op == ReduceOp::kAverage) acc /= n;
  return acc;
}

bool ProductFits(DataType dtype, int n) {
  // 2^n must fit the 8-bit types.
  return (dtype != DataType::kInt8 && dtype != DataType::kUInt8) || n < 7;
}

Request AllreduceRequest(DataType dtype, ReduceOp op, size_t count, std::vector<char>* in,
                         std::vector<char>* out) {
  Request q;
  q.kind = Kind::kAllreduce;
  q.name = "grad";
  q.op = op;
  q.tensors.push_back(Tensor(dtype, {static_cast<int64_t>(count)}, in->data(), out->data()));
  return q;
}

// Allreduces of `count` elements of every dtype and op on n ranks; checks every element on
// every rank, and that all ranks hold the same bits.
void SweepAllreduce(int n, size_t count, bool fast) {
  LocalWorld world(n);
  std::vector<std::string> failures(static_cast<size_t>(n));
  std::vector<std::vector<std::vector<char>>> outs(static_cast<size_t>(n));
  world.Run([&](int r, Transport& t) {
    HostExecutor ex(r, n, t, Config(fast));
    uint64_t seq = 1;
    for (DataType dtype : AllDataTypes()) {
      for (ReduceOp op : AllReduceOps()) {
        const size_t es = DataTypeSize(dtype);
        std::vector<char> in(count * es), out(count * es);
        for (size_t i = 0; i < count; ++i) SetFromDouble(dtype, in.data(), i, Input(r, i, op));
        Request q = AllreduceRequest(dtype, op, count, &in, &out);
        ExecutionStats stats;
        Status s = ex.Execute(q, seq++, &stats);
        if (!s.ok()) {
          At(failures, r) = s.message();
          return;
        }
        At(outs, r).push_back(out);
        if (fast && n > 1 && count * es <= keras_ring::FastRideLimit(Config(true), t) &&
            !stats.inlined) {
          At(failures, r) = "a small allreduce did not ride the fast agreement";
          return;
        }
        if (op == ReduceOp::kProduct && !ProductFits(dtype, n)) continue;
        for (size_t i = 0; i < count; ++i) {
          double want = Expected(n, i, op);
          if (!IsFloat(dtype)) want = std::trunc(want);
          const double got = GetAsDouble(dtype, out.data(), i);
          if (got != want && !(IsFloat(dtype) && std::abs(got - want) < 1e-2 * std::abs(want))) {
            At(failures, r) = "dtype " + std::to_string(static_cast<int>(dtype)) + " op " +
                              std::to_string(static_cast<int>(op)) + " element " +
                              std::to_string(i) + ": " + std::to_string(got) + " != " +
                              std::to_string(want);
            return;
          }
        }
      }
    }
  });
  world.CheckDrained(__FILE__, __LINE__);
  for (int r = 0; r < n; ++r) {
    CHECK(At(failures, r).empty()) << "n=" << n << " count=" << count << " rank " << r << ": "
                                   << At(failures, r);
    CHECK(At(outs, r) == At(outs, 0)) << "n=" << n << " rank " << r << " differs from rank 0";
  }
}

}  // namespace

// Riding the agreement (<= 64 KiB), recursive doubling (<= 128 KiB), the ring: 1-9 ranks
// (20000 elements of 1-2 bytes ride, of 4 double, of 8 take the ring).
TEST(FastPath_AllreduceEveryDtypeOpWorldAndPath) {
  for (int n = 1; n <= 9; ++n) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{257}, size_t{3000}, size_t{20000}}) {
      SweepAllreduce(n, count, /*fast=*/true);
    }
  }
}

// The same results with the fast agreement switched off (today's slot exchange + ring).
TEST(FastPath_AllreduceWithoutFastAgreement) {
  for (int n : {2, 3, 5}) {
    for (size_t count : {size_t{257}, size_t{20000}}) SweepAllreduce(n, count, /*fast=*/false);
  }
}

namespace {

// Runs `request` as collective *seq (then advances it): "" or "<what>: <the error>".
std::string Run(HostExecutor& ex, Request& request, uint64_t* seq, const std::string& what) {
  ExecutionStats stats;
  const Status s = ex.Execute(request, (*seq)++, &stats);
  return s.ok() ? "" : what + ": " + s.message();
}

// Each returns what went wrong on rank r, or nothing.
std::string CheckGrouped(HostExecutor& ex, int r, int n, size_t count, uint64_t* seq) {
  // Grouped: a float32 tensor, an int32 one, a float32 one again.
  std::vector<std::vector<int32_t>> in32(3), out32(3);
  Request g;
  g.kind = Kind::kGroupedAllreduce;
  g.name = "group";
  const DataType types[3] = {DataType::kFloat32, DataType::kInt32, DataType::kFloat32};
  for (size_t k = 0; k < 3; ++k) {
    const size_t c = count / (k + 1) + k;
    in32[k].resize(c);
    out32[k].resize(c);
    for (size_t i = 0; i < c; ++i) {
      SetFromDouble(types[k], in32[k].data(), i, Input(r, i + k, ReduceOp::kSum));
    }
    g.tensors.push_back(Tensor(types[k], {static_cast<int64_t>(c)}, in32[k].data(),
                               out32[k].data()));
  }
  if (std::string e = Run(ex, g, seq, "grouped"); !e.empty()) return e;
  for (size_t k = 0; k < 3; ++k) {
    for (size_t i = 0; i < in32[k].size(); ++i) {
      if (GetAsDouble(types[k], out32[k].data(), i) != Expected(n, i + k, ReduceOp::kSum)) {
        return "grouped tensor " + std::to_string(k) + " element " + std::to_string(i);
      }
    }
  }
  return "";
}

std::string CheckBroadcasts(HostExecutor& ex, int r, int n, size_t count, uint64_t* seq) {
  // Broadcast from every root.
  for (int root = 0; root < n; ++root) {
    std::vector<int32_t> in(count), out(count, -1);
    for (size_t i = 0; r == root && i < count; ++i) {
      in[i] = static_cast<int32_t>(Mix(root, i) & 0xffff);  // only the root's input counts
    }
    Request b;
    b.kind = Kind::kBroadcast;
    b.name = "bcast";
    b.root = root;
    b.tensors.push_back(
        Tensor(DataType::kInt32, {static_cast<int64_t>(count)}, in.data(), out.data()));
    if (std::string e = Run(ex, b, seq, "broadcast"); !e.empty()) return e;
    for (size_t i = 0; i < count; ++i) {
      if (out[i] != static_cast<int32_t>(Mix(root, i) & 0xffff)) {
        return "broadcast root " + std::to_string(root) + " element " + std::to_string(i);
      }
    }
  }
  return "";
}

std::string CheckAllgather(HostExecutor& ex, int r, int n, size_t count, uint64_t* seq) {
  // Allgather of `rows` rows of 3 (equal on every rank).
  const int64_t rows = static_cast<int64_t>(count / 3 / static_cast<size_t>(n)) + 1;
  std::vector<int32_t> gin(static_cast<size_t>(rows * 3)), gout;
  for (size_t i = 0; i < gin.size(); ++i) {
    gin[i] = static_cast<int32_t>(r * 100000 + static_cast<int>(i));
  }
  Request a;
  a.kind = Kind::kAllgather;
  a.name = "gather";
  a.tensors.push_back(Tensor(DataType::kInt32, {rows, 3}, gin.data(), nullptr));
  a.allocate_output = [&](int64_t total, void** out) {
    gout.assign(static_cast<size_t>(total * 3), -1);
    *out = gout.data();
    return Status::OK();
  };
  if (std::string e = Run(ex, a, seq, "allgather"); !e.empty()) return e;
  if (gout.size() != gin.size() * static_cast<size_t>(n)) return "allgather size";
  for (int q = 0; q < n; ++q) {
    for (size_t i = 0; i < gin.size(); ++i) {
      if (gout[static_cast<size_t>(q) * gin.size() + i] != q * 100000 + static_cast<int>(i)) {
        return "allgather block " + std::to_string(q) + " element " + std::to_string(i);
      }
    }
  }
  return "";
}

std::string CheckReducescatter(HostExecutor& ex, int r, int n, size_t count, uint64_t* seq) {
  // Reducescatter of `count` rows of 1 (uneven parts).
  const std::vector<int64_t> parts = keras_ring::ReducescatterRows(static_cast<int64_t>(count), n);
  std::vector<float> rin(count), rout(static_cast<size_t>(parts[static_cast<size_t>(r)]));
  for (size_t i = 0; i < count; ++i) rin[i] = static_cast<float>(Input(r, i, ReduceOp::kSum));
  Request rs;
  rs.kind = Kind::kReducescatter;
  rs.name = "rs";
  rs.op = ReduceOp::kAverage;
  rs.tensors.push_back(
      Tensor(DataType::kFloat32, {static_cast<int64_t>(count)}, rin.data(), rout.data()));
  if (std::string e = Run(ex, rs, seq, "reducescatter"); !e.empty()) return e;
  size_t first = 0;
  for (int q = 0; q < r; ++q) first += static_cast<size_t>(parts[static_cast<size_t>(q)]);
  for (size_t i = 0; i < rout.size(); ++i) {
    const double want = Expected(n, first + i, ReduceOp::kSum) / n;
    if (std::abs(rout[i] - want) > 1e-5 * std::abs(want) + 1e-6) {
      return "reducescatter element " + std::to_string(i);
    }
  }
  return "";
}

// Grouped allreduce (mixed dtypes), broadcast from every root, equal-row allgather and
// reducescatter, small (riding) and large, on n ranks; every rank's result checked.
void SweepOthers(int n, size_t count) {
  LocalWorld world(n);
  std::vector<std::string> failures(static_cast<size_t>(n));
  world.Run([&](int r, Transport& t) {
    HostExecutor ex(r, n, t, Config(true));
    uint64_t seq = 1;
    for (auto check : {CheckGrouped, CheckBroadcasts, CheckAllgather, CheckReducescatter}) {
      At(failures, r) = check(ex, r, n, count, &seq);
      if (!At(failures, r).empty()) return;
    }
  });
  world.CheckDrained(__FILE__, __LINE__);
  for (int r = 0; r < n; ++r) {
    CHECK(At(failures, r).empty()) << "n=" << n << " count=" << count << " rank " << r << ": "
                                   << At(failures, r);
  }
}

}  // namespace

TEST(FastPath_OtherCollectivesEveryWorld) {
  for (int n = 1; n <= 9; ++n) {
    for (size_t count : {size_t{0}, size_t{5}, size_t{300}, size_t{5000}}) SweepOthers(n, count);
  }
}

namespace {

// Every rank submits an allreduce; `odd` differs by `how`. Returns each rank's status.
std::vector<Status> Diverge(int n, int odd, int how, bool fast) {
  LocalWorld world(n);
  std::vector<Status> verdicts(static_cast<size_t>(n));
  world.Run([&](int r, Transport& t) {
    HostExecutor ex(r, n, t, Config(fast));
    size_t count = 100;
    if (r == odd && how == 0) count = 101;  // shape
    std::vector<char> in(4 * 2000), out(4 * 2000);
    Request q = AllreduceRequest(DataType::kFloat32, ReduceOp::kSum, count, &in, &out);
    if (r == odd && how == 1) q.op = ReduceOp::kMax;
    if (r == odd && how == 2) q.name = "other";
    if (r == odd && how == 3) q.tensors[0].dtype = DataType::kInt32;
    if (r == odd && how == 4) q.kind = Kind::kBroadcast;
    uint64_t seq = r == odd && how == 5 ? 8 : 7;  // ran one collective more
    if (r == odd && how == 6) q.prescale = 0.5;
    ExecutionStats stats;
    At(verdicts, r) = ex.Execute(q, seq, &stats);
    // Whatever the verdict, the runtime goes on: a matched collective must still work.
    std::vector<char> in2(4 * 3, 0), out2(4 * 3);
    Request next = AllreduceRequest(DataType::kFloat32, ReduceOp::kSum, 3, &in2, &out2);
    Status s2 = ex.Execute(next, 9, &stats);
    if (!s2.ok()) At(verdicts, r) = Status(Code::kInternal, "after: " + s2.message());
  });
  world.CheckDrained(__FILE__, __LINE__);
  return verdicts;
}

}  // namespace

// A mismatch on any rank position is seen by every rank, through the fast agreement's
// fallback, with exactly the message and blamed rank of the full exchange alone.
TEST(FastPath_MismatchAtEveryRankSameAsFullExchange) {
  for (int n = 2; n <= 9; ++n) {
    for (int odd = 0; odd < n; ++odd) {
      for (int how = 0; how < 7; ++how) {
        const std::vector<Status> fast = Diverge(n, odd, how, true);
        const std::vector<Status> full = Diverge(n, odd, how, false);
        for (int r = 0; r < n; ++r) {
          CHECK(At(fast, r).code() == Code::kFailedPrecondition)
              << "n=" << n << " odd=" << odd << " how=" << how << " rank " << r << ": "
              << At(fast, r).message();
          CHECK_EQ(At(fast, r).message(), At(full, r).message());
          CHECK_EQ(At(fast, r).peer(), At(full, r).peer());
        }
      }
    }
  }
}

// A collective whose data rides on some ranks only (here rank `bare` brings none) is still
// agreed, on every rank, and delivered on none: the outputs stay untouched and the streams in
// step (the same ranks then complete a collective that rides everywhere).
TEST(FastPath_DataRidingOnSomeRanksOnlyIsDeliveredNowhere) {
  for (int n : {2, 3, 5, 8}) {
    for (int bare = 0; bare < n; ++bare) {
      LocalWorld world(n);
      std::vector<std::string> failures(static_cast<size_t>(n));
      world.Run([&](int r, Transport& t) {
        keras_ring::FastAgreement fast;
        std::atomic<int> progress{0};
        int waited_on = -1;
        for (int pass = 0; pass < 2; ++pass) {
          std::vector<char> in(4 * 1000, 1), out(4 * 1000, 0);
          Request q = AllreduceRequest(DataType::kFloat32, ReduceOp::kSum, 1000, &in, &out);
          for (size_t i = 0; i < 1000; ++i) SetFromDouble(DataType::kFloat32, in.data(), i, 1.0);
          const bool rides = pass == 1 || r != bare;
          bool agreed = false, delivered = false;
          Status s = fast.Run(t, Config(true), 0, q, rides ? &q : nullptr,
                              keras_ring::SignatureOf(q, 3 + static_cast<uint64_t>(pass)),
                              &agreed, &delivered, &progress, &waited_on);
          const double first = GetAsDouble(DataType::kFloat32, out.data(), 0);
          const bool want_delivered = pass == 1;
          if (!s.ok() || !agreed || delivered != want_delivered ||
              first != (want_delivered ? n : 0.0)) {
            At(failures, r) = "pass " + std::to_string(pass) + ": " + s.message() +
                              " agreed=" + std::to_string(agreed) + " delivered=" +
                              std::to_string(delivered) + " out[0]=" + std::to_string(first);
            return;
          }
        }
      });
      world.CheckDrained(__FILE__, __LINE__);
      for (int r = 0; r < n; ++r) {
        CHECK(At(failures, r).empty()) << "n=" << n << " bare=" << bare << " rank " << r << ": "
                                       << At(failures, r);
      }
    }
  }
}

// Every rank's "not heard from" set while stalled in the agreement holds the stalled rank,
// and the set shrinks to nothing as the exchange completes.
TEST(FastPath_NotHeardFromHoldsTheStalledRank) {
  for (int n = 1; n <= 33; ++n) {
    const int p = keras_ring::PowerOfTwoBelow(n);
    int rounds = 0;
    while ((1 << rounds) < p) ++rounds;
    for (int r = 0; r < n; ++r) {
      const bool has_extra = r < p && r + p < n;
      const int last = r >= p ? 1 : rounds + (has_extra ? 1 : 0);
      CHECK(keras_ring::DoublingNotHeardFrom(r, n, last).empty()) << n << " " << r;
      const std::vector<int> none = keras_ring::DoublingNotHeardFrom(r, n, 0);
      CHECK_EQ(none.size(), static_cast<size_t>(n - 1)) << n << " " << r;
      for (int k = 1; k < last; ++k) {
        const auto a = keras_ring::DoublingNotHeardFrom(r, n, k - 1);
        const auto b = keras_ring::DoublingNotHeardFrom(r, n, k);
        CHECK(b.size() < a.size()) << n << " " << r << " " << k;
      }
    }
  }
}

// A rank that never submits: every other rank times out naming a rank (its direct waiters
// name it; see DepthMargin for the others), and no wait outlasts its bound.
TEST(FastPath_StallIsBoundedOnEveryRank) {
  for (int n : {2, 3, 4, 5, 8}) {
    const int stalled = n - 2;
    LocalWorld world(n);
    std::vector<Status> verdicts(static_cast<size_t>(n));
    world.Run([&](int r, Transport& t) {
      if (r == stalled) return;
      AlgoConfig cfg = Config(true);
      cfg.timeout_seconds = 0.2;
      HostExecutor ex(r, n, t, cfg);
      std::vector<char> in(40), out(40);
      Request q = AllreduceRequest(DataType::kFloat32, ReduceOp::kSum, 10, &in, &out);
      ExecutionStats stats;
      At(verdicts, r) = ex.Execute(q, 1, &stats);
    });
    for (int r = 0; r < n; ++r) {
      if (r == stalled) continue;
      CHECK(At(verdicts, r).code() == Code::kDeadlineExceeded)
          << n << " rank " << r << ": " << At(verdicts, r).message();
      CHECK_CONTAINS(At(verdicts, r).message(), "to submit allreduce 'grad'");
    }
    // The stalled rank's partner in the first round it takes part in names it.
    const int partner = stalled ^ 1;
    if (partner < n && partner != stalled) {
      CHECK_EQ(At(verdicts, partner).peer(), stalled);
    }
  }
}

}  // namespace kr_test
