// RingAllreduce over the local transport: 1-8 ranks as threads; element counts 0, 1, 7,
// 13 (prime), one not divisible by the rank count, and one spanning many segments; every
// dtype and op, with and without prescale/postscale. Expected values are computed here,
// independently of the reduce kernels: in double for floats (inputs chosen so that sums and
// products are exact), in wrapping integer arithmetic for integers.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../core/algorithms.h"
#include "../core/reduce.h"
#include "test_harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using keras_ring::AlgoConfig;
using keras_ring::DataType;
using keras_ring::DataTypeName;
using keras_ring::DataTypeSize;
using keras_ring::ReduceOp;
using keras_ring::ReduceOpName;
using keras_ring::Status;
using keras_ring::Transport;

struct Case {
  DataType dtype;
  ReduceOp op;
  size_t count;
  double pre;
  double post;
};

std::string Describe(const Case& c, int n) {
  return "ranks=" + std::to_string(n) + " " + DataTypeName(c.dtype) + " " +
         ReduceOpName(c.op) + " count=" + std::to_string(c.count) +
         " pre=" + Show(c.pre) + " post=" + Show(c.post);
}

// ---- inputs ----

bool Scaled(const Case& c) { return c.pre != 1.0 || c.post != 1.0; }

// Float inputs are small integers (or +-2^k for Product) so every partial result is exact in
// every float type, whichever order the ring reduces in.
double FloatInput(const Case& c, int rank, size_t i, uint64_t salt) {
  const uint64_t h = Mix(salt, static_cast<uint64_t>(rank), i);
  if (c.op == ReduceOp::kProduct) {
    static const double kFactors[] = {1.0, -1.0, 2.0, 0.5, -2.0};
    return kFactors[h % 5];
  }
  return static_cast<double>(h % 17) - 8.0;
}

// Integer inputs cover the whole range, so Sum and Product wrap. int64 goes through double
// when scaled, so scaled int64 cases stay small enough to be exact there.
int64_t IntInput(const Case& c, int rank, size_t i, uint64_t salt) {
  const uint64_t h = Mix(salt, static_cast<uint64_t>(rank), i);
  if (c.dtype == DataType::kInt64 && Scaled(c)) {
    return c.op == ReduceOp::kProduct ? static_cast<int64_t>(h % 7) - 3
                                      : static_cast<int64_t>(h % 2001) - 1000;
  }
  return static_cast<int64_t>(h);
}

std::vector<char> MakeInput(const Case& c, int rank, uint64_t salt) {
  std::vector<char> buf(c.count * DataTypeSize(c.dtype));
  for (size_t i = 0; i < c.count; ++i) {
    if (IsFloat(c.dtype)) {
      SetFromDouble(c.dtype, buf.data(), i, FloatInput(c, rank, i, salt));
    } else {
      const int64_t v = IntInput(c, rank, i, salt);  // stored truncated: wraps into the type
      std::memcpy(buf.data() + i * DataTypeSize(c.dtype), &v, DataTypeSize(c.dtype));
    }
  }
  return buf;
}

// ---- expected values ----

double Combine(ReduceOp op, double a, double b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAverage: return a + b;
    case ReduceOp::kProduct: return a * b;
    case ReduceOp::kMin: return a < b ? a : b;
    case ReduceOp::kMax: return a > b ? a : b;
  }
  return 0;
}

double ExpectedFloat(const Case& c, int n, size_t i, uint64_t salt) {
  double acc = 0;
  for (int r = 0; r < n; ++r) {
    const double x = FloatInput(c, r, i, salt) * c.pre;  // pre is a power of two: exact
    acc = r == 0 ? x : Combine(c.op, acc, x);
  }
  return c.op == ReduceOp::kAverage ? acc * c.post / n : acc * c.post;
}

// Truncates toward zero and saturates, as documented for integer scaling.
template <typename T>
T SatScale(T x, double f) {
  if (f == 1.0) return x;
  const double v = std::trunc(static_cast<double>(x) * f);
  if (v <= static_cast<double>(std::numeric_limits<T>::min())) return std::numeric_limits<T>::min();
  if (v >= static_cast<double>(std::numeric_limits<T>::max())) return std::numeric_limits<T>::max();
  return static_cast<T>(v);
}

template <typename T>
T ExpectedInt(const Case& c, int n, size_t i, uint64_t salt) {
  T acc = 0;
  for (int r = 0; r < n; ++r) {
    const T x = SatScale(static_cast<T>(IntInput(c, r, i, salt)), c.pre);
    const uint64_t a = static_cast<uint64_t>(acc), b = static_cast<uint64_t>(x);
    if (r == 0) {
      acc = x;
    } else if (c.op == ReduceOp::kSum || c.op == ReduceOp::kAverage) {
      acc = static_cast<T>(a + b);  // modulo 2^64, then modulo the type's width
    } else if (c.op == ReduceOp::kProduct) {
      acc = static_cast<T>(a * b);
    } else if (c.op == ReduceOp::kMin) {
      acc = x < acc ? x : acc;
    } else {
      acc = x > acc ? x : acc;
    }
  }
  // Average: exact division, or with a postscale one truncation of sum * post / n.
  if (c.op == ReduceOp::kAverage && c.post != 1.0) return SatScale(acc, c.post / n);
  if (c.op == ReduceOp::kAverage) acc = static_cast<T>(acc / static_cast<T>(n));
  return SatScale(acc, c.post);
}

double ExpectedIntAsDouble(const Case& c, int n, size_t i, uint64_t salt) {
  switch (c.dtype) {
    case DataType::kInt8: return ExpectedInt<int8_t>(c, n, i, salt);
    case DataType::kUInt8: return ExpectedInt<uint8_t>(c, n, i, salt);
    case DataType::kInt16: return ExpectedInt<int16_t>(c, n, i, salt);
    case DataType::kUInt16: return ExpectedInt<uint16_t>(c, n, i, salt);
    case DataType::kInt32: return ExpectedInt<int32_t>(c, n, i, salt);
    default: return static_cast<double>(ExpectedInt<int64_t>(c, n, i, salt));
  }
}

// int64 results are compared exactly, not through double.
bool Int64Matches(const Case& c, int n, size_t i, uint64_t salt, const char* out) {
  int64_t got;
  std::memcpy(&got, out + i * 8, 8);
  return got == ExpectedInt<int64_t>(c, n, i, salt);
}

// Relative and absolute tolerance: one unit in the last place of the dtype.
bool Close(DataType dtype, double got, double want) {
  double rel = 0x1p-50, abs = 1e-300;
  if (dtype == DataType::kFloat16) rel = 0x1p-10, abs = 0x1p-24;
  if (dtype == DataType::kBFloat16) rel = 0x1p-7, abs = 1e-38;
  if (dtype == DataType::kFloat32) rel = 0x1p-23, abs = 1e-38;
  return std::fabs(got - want) <= rel * std::fabs(want) + abs;
}

// Checks `count` result elements, the reduction of elements first.. of the inputs, one by
// one (reporting the first wrong one).
void CheckElements(const Case& c, int n, uint64_t salt, size_t first, size_t count,
                   const char* got_data, const std::string& who) {
  const bool exact = !IsFloat(c.dtype) || (c.post == 1.0 && c.op != ReduceOp::kAverage);
  for (size_t j = 0; j < count; ++j) {
    const size_t i = first + j;
    const double got = GetAsDouble(c.dtype, got_data, j);
    bool ok;
    double want;
    if (c.dtype == DataType::kInt64) {
      want = static_cast<double>(ExpectedInt<int64_t>(c, n, i, salt));
      ok = Int64Matches(c, n, i, salt, got_data - first * DataTypeSize(c.dtype));
    } else {
      want = IsFloat(c.dtype) ? ExpectedFloat(c, n, i, salt) : ExpectedIntAsDouble(c, n, i, salt);
      ok = exact ? got == want : Close(c.dtype, got, want);
    }
    if (!ok) {
      CHECK(ok) << Describe(c, n) << who << " element " << i << ": got " << got << ", expected "
                << want;
      break;
    }
  }
}

// Checks rank 0's result element by element and every other rank's result for bitwise
// identity with rank 0's.
void CheckResult(const Case& c, int n, uint64_t salt, const std::vector<std::vector<char>>& out) {
  CheckElements(c, n, salt, 0, c.count, out[0].data(), "");
  for (int r = 1; r < n; ++r) {
    CHECK(At(out, r) == out[0])
        << Describe(c, n) << ": rank " << r << " differs from rank 0";
  }
}

// Runs every case on `n` ranks, one after the other on the same transports, then checks.
// Out of place, the input must be left untouched and the output's old contents ignored.
void RunCases(int n, const std::vector<Case>& cases, const AlgoConfig& cfg,
              bool out_of_place = false) {
  LocalWorld world(n);
  std::vector<std::vector<std::vector<char>>> in(cases.size()), out(cases.size());  // [case][rank]
  for (size_t k = 0; k < cases.size(); ++k) {
    for (int r = 0; r < n; ++r) in[k].push_back(MakeInput(cases[k], r, k));
    out[k] = out_of_place ? std::vector<std::vector<char>>(
                                static_cast<size_t>(n), std::vector<char>(in[k][0].size(), '\xEE'))
                          : in[k];
  }
  std::vector<std::vector<Status>> status(cases.size(), std::vector<Status>(n));
  world.Run([&](int r, Transport& t) {
    const size_t ur = static_cast<size_t>(r);
    for (size_t k = 0; k < cases.size(); ++k) {
      const Case& c = cases[k];
      status[k][ur] = out_of_place
          ? keras_ring::RingAllreduce(t, cfg, c.dtype, c.op, in[k][ur].data(), out[k][ur].data(),
                                      c.count, c.pre, c.post)
          : keras_ring::RingAllreduce(t, cfg, c.dtype, c.op, out[k][ur].data(), c.count, c.pre,
                                      c.post);
      if (!status[k][ur].ok()) return;  // the streams are out of step now
    }
  });
  for (size_t k = 0; k < cases.size(); ++k) {
    bool all_ok = true;
    for (int r = 0; r < n; ++r) {
      const Status& s = At(status[k], r);
      all_ok = all_ok && s.ok();
      CHECK_OK(s) << Describe(cases[k], n) << " on rank " << r;
      if (out_of_place) {
        CHECK(At(in[k], r) == MakeInput(cases[k], r, k))
            << Describe(cases[k], n) << ": out of place, rank " << r << "'s input changed";
      }
    }
    if (!all_ok) return;
    CheckResult(cases[k], n, k, out[k]);
  }
  world.CheckDrained(__FILE__, __LINE__);
}

// Every dtype x op x {unscaled, prescale 0.5 + postscale 3} for each count.
std::vector<Case> AllCases(const std::vector<size_t>& counts) {
  const double scales[][2] = {{1.0, 1.0}, {0.5, 3.0}};
  std::vector<Case> cases;
  for (size_t count : counts) {
    for (DataType dtype : AllDataTypes()) {
      for (ReduceOp op : AllReduceOps()) {
        for (const auto& s : scales) cases.push_back(Case{dtype, op, count, s[0], s[1]});
      }
    }
  }
  return cases;
}

AlgoConfig Config(size_t segment_bytes) {
  AlgoConfig cfg;
  cfg.timeout_seconds = 2.0;  // per wait: a bug fails fast instead of hanging
  cfg.segment_bytes = segment_bytes;
  return cfg;
}

// The counts of the issue: 0, 1, 7, 13 (prime), one not divisible by n, and 517, which
// spans many 64-byte segments at every rank count.
void Sweep(int n) {
  RunCases(n, AllCases({0, 1, 7, 13, static_cast<size_t>(5 * n + 1), 517}), Config(64));
}

}  // namespace

TEST(RingAllreduce_1Rank) { Sweep(1); }
TEST(RingAllreduce_2Ranks) { Sweep(2); }
TEST(RingAllreduce_3Ranks) { Sweep(3); }
TEST(RingAllreduce_4Ranks) { Sweep(4); }
TEST(RingAllreduce_5Ranks) { Sweep(5); }
TEST(RingAllreduce_6Ranks) { Sweep(6); }
TEST(RingAllreduce_7Ranks) { Sweep(7); }
TEST(RingAllreduce_8Ranks) { Sweep(8); }

// Segment sizes that are not a multiple of the element size, or smaller than one element,
// still move whole elements.
TEST(RingAllreduce_OddSegmentSizes) {
  for (size_t seg : {1, 3, 6, 20}) {
    std::vector<Case> cases;
    for (DataType dtype : {DataType::kFloat16, DataType::kFloat64, DataType::kInt32}) {
      cases.push_back(Case{dtype, ReduceOp::kSum, 41, 1.0, 1.0});
      cases.push_back(Case{dtype, ReduceOp::kAverage, 41, 2.0, 0.5});
    }
    RunCases(3, cases, Config(seg));
    RunCases(5, cases, Config(seg));
  }
}

// The out-of-place overload: input only read, output fully written, same results.
TEST(RingAllreduce_OutOfPlace) {
  for (int n : {1, 2, 3, 8}) RunCases(n, AllCases({0, 1, 13, 517}), Config(64), true);
}

// Outputs written through the L1 block with streaming stores (every size streams here), with
// the final scaling fused into the last reduce-scatter step: same results, in and out of
// place, for counts that span several 8 KiB blocks and end mid-block.
TEST(RingAllreduce_StreamingStores) {
  AlgoConfig cfg = Config(4096);
  cfg.stream_bytes = 0;
  for (int n : {2, 3}) {
    RunCases(n, AllCases({1, 13, 5000}), cfg);
    RunCases(n, AllCases({1, 13, 5000}), cfg, true);
  }
}

// Average of integers divides the exact (wrapped) sum, truncating toward zero.
TEST(RingAllreduce_IntegerAverageTruncates) {
  const AlgoConfig cfg = Config(64);
  LocalWorld world(3);
  std::vector<std::vector<int32_t>> bufs = {{1, -1, 5, -5, 100}, {1, -1, 0, 0, 0}, {0, 0, 0, 0, 0}};
  std::vector<Status> status(3);
  world.Run([&](int r, Transport& t) {
    At(status, r) = keras_ring::RingAllreduce(
        t, cfg, DataType::kInt32, ReduceOp::kAverage, At(bufs, r).data(), 5, 1.0, 1.0);
  });
  const std::vector<int32_t> want = {0, 0, 1, -1, 33};
  for (size_t r = 0; r < 3; ++r) {
    CHECK_OK(status[r]);
    CHECK(bufs[r] == want) << "rank " << r << ": " << bufs[r][0] << " " << bufs[r][1] << " "
                           << bufs[r][2] << " " << bufs[r][3] << " " << bufs[r][4];
  }
}

// ---- reduce-scatter ----

// The parts of `count` elements over n ranks: Horovod's rows rule (the first count % n one
// more), or everything on the last rank (every other part empty).
std::vector<size_t> Parts(size_t count, int n, bool skewed) {
  std::vector<size_t> parts(static_cast<size_t>(n), 0);
  if (skewed) {
    parts.back() = count;
    return parts;
  }
  for (int r = 0; r < n; ++r) {
    At(parts, r) = count / static_cast<size_t>(n) + (static_cast<size_t>(r) < count % n ? 1 : 0);
  }
  return parts;
}

// Every case as a reduce-scatter: rank r's output must be the reduction of its part of the
// inputs (checked against the same independent expectation as the allreduce), and the
// inputs must be left untouched.
void RunReduceScatter(int n, const std::vector<Case>& cases, const AlgoConfig& cfg, bool skewed) {
  LocalWorld world(n);
  std::vector<std::vector<std::vector<char>>> in(cases.size()), out(cases.size());
  std::vector<std::vector<size_t>> parts;
  for (size_t k = 0; k < cases.size(); ++k) {
    parts.push_back(Parts(cases[k].count, n, skewed));
    for (int r = 0; r < n; ++r) {
      in[k].push_back(MakeInput(cases[k], r, k));
      out[k].emplace_back(At(parts[k], r) * DataTypeSize(cases[k].dtype), '\xEE');
    }
  }
  std::vector<std::vector<Status>> status(cases.size(), std::vector<Status>(n));
  world.Run([&](int r, Transport& t) {
    const size_t ur = static_cast<size_t>(r);
    for (size_t k = 0; k < cases.size(); ++k) {
      const Case& c = cases[k];
      status[k][ur] = keras_ring::RingReduceScatter(t, cfg, c.dtype, c.op, in[k][ur].data(),
                                                    out[k][ur].data(), parts[k], c.pre, c.post);
      if (!status[k][ur].ok()) return;
    }
  });
  for (size_t k = 0; k < cases.size(); ++k) {
    size_t first = 0;
    for (int r = 0; r < n; ++r) {
      CHECK_OK(At(status[k], r)) << Describe(cases[k], n) << " on rank " << r;
      if (!At(status[k], r).ok()) return;
      CHECK(At(in[k], r) == MakeInput(cases[k], r, k))
          << Describe(cases[k], n) << ": rank " << r << "'s input changed";
      CheckElements(cases[k], n, k, first, At(parts[k], r), At(out[k], r).data(),
                    " reduce-scatter rank " + std::to_string(r));
      first += At(parts[k], r);
    }
  }
  world.CheckDrained(__FILE__, __LINE__);
}

TEST(RingReduceScatter_1To8Ranks) {
  for (int n = 1; n <= 8; ++n) {
    RunReduceScatter(n, AllCases({0, 1, 7, static_cast<size_t>(5 * n + 1), 517}), Config(64),
                     /*skewed=*/false);
  }
}

// Empty parts on every rank but one, and segments smaller than an element.
TEST(RingReduceScatter_EmptyPartsAndOddSegments) {
  for (int n : {2, 3, 5}) RunReduceScatter(n, AllCases({13}), Config(64), /*skewed=*/true);
  std::vector<Case> cases;
  for (DataType dtype : {DataType::kFloat16, DataType::kFloat64, DataType::kInt16}) {
    cases.push_back(Case{dtype, ReduceOp::kAverage, 41, 2.0, 0.5});
  }
  for (size_t seg : {1, 3, 20}) RunReduceScatter(4, cases, Config(seg), /*skewed=*/false);
}

}  // namespace kr_test
