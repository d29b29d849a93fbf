// Reduce / Scale / AverageScale edge cases and the 16-bit float conversions, against known
// bit patterns.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../core/reduce.h"
#include "test_harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using keras_ring::BFloat16ToFloat;
using keras_ring::DataType;
using keras_ring::FloatToBFloat16;
using keras_ring::FloatToHalf;
using keras_ring::HalfToFloat;
using keras_ring::ReduceOp;

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();
const DataType kFloatTypes[] = {DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32,
                                DataType::kFloat64};

// dst (op)= src elementwise in `dtype`, inputs and result as doubles.
std::vector<double> ReduceAs(DataType dtype, ReduceOp op, const std::vector<double>& a,
                             const std::vector<double>& b) {
  const size_t es = keras_ring::DataTypeSize(dtype);
  std::vector<char> dst(a.size() * es), src(b.size() * es);
  for (size_t i = 0; i < a.size(); ++i) {
    SetFromDouble(dtype, dst.data(), i, a[i]);
    SetFromDouble(dtype, src.data(), i, b[i]);
  }
  keras_ring::Reduce(dtype, op, dst.data(), src.data(), a.size());
  std::vector<double> out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = GetAsDouble(dtype, dst.data(), i);
  return out;
}

template <typename T>
std::vector<T> ScaleInts(std::vector<T> v, double factor) {
  DataType dtype = DataType::kInt64;
  if (std::is_same_v<T, int8_t>) dtype = DataType::kInt8;
  if (std::is_same_v<T, uint8_t>) dtype = DataType::kUInt8;
  if (std::is_same_v<T, int32_t>) dtype = DataType::kInt32;
  keras_ring::Scale(dtype, v.data(), v.size(), factor);
  return v;
}

template <typename T>
T ReduceInt(DataType dtype, ReduceOp op, T a, T b) {
  keras_ring::Reduce(dtype, op, &a, &b, 1);
  return a;
}

}  // namespace

TEST(Reduce_NaNPropagatesThroughMinMaxSum) {
  const std::vector<double> a = {kNaN, 1.0, kNaN, -kInf};
  const std::vector<double> b = {1.0, kNaN, kNaN, kNaN};
  for (DataType dtype : kFloatTypes) {
    for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kSum, ReduceOp::kProduct}) {
      const std::vector<double> out = ReduceAs(dtype, op, a, b);
      for (size_t i = 0; i < out.size(); ++i) {
        CHECK(std::isnan(out[i])) << keras_ring::DataTypeName(dtype) << " "
                                  << keras_ring::ReduceOpName(op) << " element " << i << " = "
                                  << out[i];
      }
    }
  }
}

TEST(Reduce_Infinities) {
  for (DataType dtype : kFloatTypes) {
    const char* name = keras_ring::DataTypeName(dtype);
    const auto sum = ReduceAs(dtype, ReduceOp::kSum, {kInf, kInf, -kInf}, {1.0, -kInf, -5.0});
    CHECK(sum[0] == kInf) << name;
    CHECK(std::isnan(sum[1])) << name;
    CHECK(sum[2] == -kInf) << name;
    const auto mx = ReduceAs(dtype, ReduceOp::kMax, {-kInf, kInf, 3.0}, {3.0, 3.0, -kInf});
    CHECK(mx[0] == 3.0 && mx[1] == kInf && mx[2] == 3.0) << name;
    const auto mn = ReduceAs(dtype, ReduceOp::kMin, {kInf, -kInf, 3.0}, {3.0, 3.0, kInf});
    CHECK(mn[0] == 3.0 && mn[1] == -kInf && mn[2] == 3.0) << name;
    const auto prod = ReduceAs(dtype, ReduceOp::kProduct, {kInf, kInf}, {0.0, -2.0});
    CHECK(std::isnan(prod[0]) && prod[1] == -kInf) << name;
  }
}

TEST(Reduce_HalfOverflowsToInfinity) {
  // 60000 + 10000 is beyond float16's largest finite value (65504).
  const auto sum =
      ReduceAs(DataType::kFloat16, ReduceOp::kSum, {60000.0, -60000.0}, {10000.0, -10000.0});
  CHECK(sum[0] == kInf && sum[1] == -kInf) << sum[0] << " " << sum[1];
}

// Reduce16 works in blocks of 256: counts around and across the block boundary.
TEST(Reduce_SixteenBitBlocks) {
  for (DataType dtype : {DataType::kFloat16, DataType::kBFloat16}) {
    for (size_t n : {255, 256, 257, 600}) {
      std::vector<double> a(n), b(n);
      for (size_t i = 0; i < n; ++i) {
        a[i] = static_cast<double>(i % 50) - 25.0;
        b[i] = static_cast<double>(i % 7);
      }
      const auto sum = ReduceAs(dtype, ReduceOp::kSum, a, b);
      const auto mx = ReduceAs(dtype, ReduceOp::kMax, a, b);
      for (size_t i = 0; i < n; ++i) {
        CHECK_EQ(sum[i], a[i] + b[i]) << " n=" << n << " i=" << i;
        CHECK_EQ(mx[i], std::max(a[i], b[i])) << " n=" << n << " i=" << i;
      }
    }
  }
}

// The three-operand form: dst = a (op) b, with dst distinct from a or equal to it.
TEST(Reduce_ThreeOperandForm) {
  for (DataType dtype : AllDataTypes()) {
    for (ReduceOp op : AllReduceOps()) {
      const size_t es = keras_ring::DataTypeSize(dtype), n = 300;  // > one 16-bit block
      std::vector<char> a(n * es), b(n * es), dst(n * es, '\xEE'), in_place;
      for (size_t i = 0; i < n; ++i) {
        SetFromDouble(dtype, a.data(), i, static_cast<double>(i % 9));
        SetFromDouble(dtype, b.data(), i, static_cast<double>(i % 4) + 1.0);
      }
      const std::vector<char> a0 = a, b0 = b;
      keras_ring::Reduce(dtype, op, dst.data(), a.data(), b.data(), n);
      CHECK(a == a0 && b == b0) << keras_ring::DataTypeName(dtype) << ": operands changed";
      in_place = a;
      keras_ring::Reduce(dtype, op, in_place.data(), b.data(), n);  // two-operand form
      const std::string what =
          std::string(keras_ring::DataTypeName(dtype)) + " " + keras_ring::ReduceOpName(op);
      CHECK(dst == in_place) << what;
      keras_ring::Reduce(dtype, op, a.data(), a.data(), b.data(), n);  // dst aliases a
      CHECK(a == in_place) << what;
      const double want[] = {11.0, 11.0, 4.0, 7.0, 28.0};  // element 7: a = 7, b = 4
      CHECK_EQ(GetAsDouble(dtype, dst.data(), 7), want[static_cast<int>(op)]) << " " << what;
    }
  }
}

TEST(Half_KnownBitPatterns) {
  CHECK_EQ(FloatToHalf(1.0f), 0x3C00);
  CHECK_EQ(FloatToHalf(-2.0f), 0xC000);
  CHECK_EQ(FloatToHalf(0.0f), 0x0000);
  CHECK_EQ(FloatToHalf(-0.0f), 0x8000);
  CHECK_EQ(FloatToHalf(65504.0f), 0x7BFF);              // largest finite
  CHECK_EQ(FloatToHalf(std::nextafter(65520.0f, 0.0f)), 0x7BFF);  // just below the tie
  CHECK_EQ(FloatToHalf(65520.0f), 0x7C00);              // tie rounds to even: infinity
  CHECK_EQ(FloatToHalf(-65520.0f), 0xFC00);
  CHECK_EQ(FloatToHalf(1e10f), 0x7C00);
  CHECK_EQ(FloatToHalf(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  CHECK_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  CHECK_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);  // tie between 0 and 1: even
  CHECK_EQ(FloatToHalf(std::ldexp(1.0f, -25) * 1.0001f), 0x0001);
  CHECK_EQ(FloatToHalf(std::ldexp(3.0f, -25)), 0x0002);  // tie between 1 and 2: even
  CHECK_EQ(FloatToHalf(std::ldexp(5.0f, -25)), 0x0002);  // tie between 2 and 3: even
  CHECK_EQ(FloatToHalf(std::ldexp(1.0f, -26)), 0x0000);
  CHECK_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3C00);         // tie: even
  CHECK_EQ(FloatToHalf(1.0f + std::ldexp(3.0f, -11)), 0x3C02);         // tie: even
  CHECK_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11) * 1.01f), 0x3C01);  // above the tie
  CHECK_EQ(FloatToHalf(2047.0f / 1024.0f + std::ldexp(1.0f, -11)), 0x4000);  // carry to exponent
  CHECK_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7C00);
  const uint16_t nan = FloatToHalf(std::numeric_limits<float>::quiet_NaN());
  CHECK((nan & 0x7C00) == 0x7C00 && (nan & 0x03FF) != 0) << nan;

  CHECK_EQ(HalfToFloat(0x3C00), 1.0f);
  CHECK_EQ(HalfToFloat(0x7BFF), 65504.0f);
  CHECK_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  CHECK_EQ(HalfToFloat(0x03FF), std::ldexp(1023.0f, -24));
  CHECK_EQ(HalfToFloat(0x0400), std::ldexp(1.0f, -14));
  CHECK_EQ(HalfToFloat(0x8001), -std::ldexp(1.0f, -24));
  CHECK_EQ(HalfToFloat(0x7C00), std::numeric_limits<float>::infinity());
  CHECK_EQ(HalfToFloat(0xFC00), -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(HalfToFloat(0x7E00)));
  CHECK(std::isnan(HalfToFloat(0x7C01)));
  CHECK(std::signbit(HalfToFloat(0x8000)) && HalfToFloat(0x8000) == 0.0f);
}

TEST(Half_RoundTripsEveryBitPattern) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    const bool is_nan = (h & 0x7C00) == 0x7C00 && (h & 0x03FF) != 0;
    if (is_nan) {
      CHECK(std::isnan(f) && std::isnan(HalfToFloat(FloatToHalf(f)))) << h;
      continue;
    }
    const uint16_t back = FloatToHalf(f);
    if (back != h) {
      CHECK_EQ(back, h) << " for " << f;
      break;
    }
  }
}

TEST(BFloat16_KnownBitPatterns) {
  CHECK_EQ(FloatToBFloat16(1.0f), 0x3F80);
  CHECK_EQ(FloatToBFloat16(-1.0f), 0xBF80);
  CHECK_EQ(FloatToBFloat16(1.00390625f), 0x3F80);             // 1 + 2^-8: tie, even is down
  CHECK_EQ(FloatToBFloat16(1.01171875f), 0x3F82);             // 1 + 3*2^-8: tie, even is up
  CHECK_EQ(FloatToBFloat16(std::nextafter(1.00390625f, 2.0f)), 0x3F81);  // above the tie
  CHECK_EQ(FloatToBFloat16(std::nextafter(1.01171875f, 0.0f)), 0x3F81);  // below the tie
  CHECK_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7F80);  // rounds to inf
  CHECK_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7F80);
  CHECK_EQ(FloatToBFloat16(-std::numeric_limits<float>::infinity()), 0xFF80);
  CHECK_EQ(FloatToBFloat16(std::ldexp(1.0f, -133)), 0x0001);  // smallest bf16 subnormal
  CHECK_EQ(FloatToBFloat16(-0.0f), 0x8000);
  const uint16_t nan = FloatToBFloat16(std::numeric_limits<float>::quiet_NaN());
  CHECK((nan & 0x7F80) == 0x7F80 && (nan & 0x007F) != 0) << nan;
  // A NaN whose payload sits only in the low 16 bits must not turn into infinity.
  uint32_t low_nan_bits = 0x7F800001u;
  float low_nan;
  std::memcpy(&low_nan, &low_nan_bits, sizeof low_nan);
  CHECK(std::isnan(BFloat16ToFloat(FloatToBFloat16(low_nan))));
  CHECK_EQ(BFloat16ToFloat(0x3F80), 1.0f);
  CHECK_EQ(BFloat16ToFloat(0x4049), 3.140625f);
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    const float f = BFloat16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    if (FloatToBFloat16(f) != b) {
      CHECK_EQ(FloatToBFloat16(f), b);
      break;
    }
  }
}

TEST(Reduce_IntegerSumAndProductWrap) {
  CHECK_EQ(ReduceInt<int8_t>(DataType::kInt8, ReduceOp::kSum, 127, 1), -128);
  CHECK_EQ(ReduceInt<int8_t>(DataType::kInt8, ReduceOp::kSum, -128, -1), 127);
  CHECK_EQ(ReduceInt<uint8_t>(DataType::kUInt8, ReduceOp::kSum, 255, 1), 0);
  CHECK_EQ(ReduceInt<int32_t>(DataType::kInt32, ReduceOp::kSum, INT32_MAX, 1), INT32_MIN);
  CHECK_EQ(ReduceInt<int64_t>(DataType::kInt64, ReduceOp::kSum, INT64_MAX, 1), INT64_MIN);
  CHECK_EQ(ReduceInt<int64_t>(DataType::kInt64, ReduceOp::kAverage, INT64_MIN, -1), INT64_MAX);
  CHECK_EQ(ReduceInt<int8_t>(DataType::kInt8, ReduceOp::kProduct, 16, 16), 0);
  CHECK_EQ(ReduceInt<int8_t>(DataType::kInt8, ReduceOp::kProduct, -128, -1), -128);
  CHECK_EQ(ReduceInt<int8_t>(DataType::kInt8, ReduceOp::kProduct, 11, 13), -113);  // 143 - 256
  CHECK_EQ(ReduceInt<uint8_t>(DataType::kUInt8, ReduceOp::kProduct, 200, 2), 144);
  CHECK_EQ(ReduceInt<int32_t>(DataType::kInt32, ReduceOp::kProduct, 65536, 65536), 0);
  CHECK_EQ(ReduceInt<int32_t>(DataType::kInt32, ReduceOp::kProduct, INT32_MIN, -1), INT32_MIN);
  CHECK_EQ(ReduceInt<int64_t>(DataType::kInt64, ReduceOp::kProduct, INT64_MIN, -1), INT64_MIN);
  const int64_t two32 = int64_t{1} << 32;
  CHECK_EQ(ReduceInt<int64_t>(DataType::kInt64, ReduceOp::kProduct, two32, 3 * two32), 0);
  CHECK_EQ(ReduceInt<int8_t>(DataType::kInt8, ReduceOp::kMin, -128, 127), -128);
  CHECK_EQ(ReduceInt<uint8_t>(DataType::kUInt8, ReduceOp::kMax, 0, 255), 255);
  CHECK_EQ(ReduceInt<int64_t>(DataType::kInt64, ReduceOp::kMin, INT64_MIN, INT64_MAX), INT64_MIN);
}

TEST(Scale_IntegersTruncateAndSaturate) {
  CHECK(ScaleInts<int8_t>({100, -100, 7, -7, 63}, 2.0) ==
        std::vector<int8_t>({127, -128, 14, -14, 126}));
  CHECK(ScaleInts<int8_t>({7, -7, 1, -1}, 0.5) == std::vector<int8_t>({3, -3, 0, 0}));
  CHECK(ScaleInts<uint8_t>({200, 5, 0}, 2.0) == std::vector<uint8_t>({255, 10, 0}));
  CHECK(ScaleInts<uint8_t>({5, 200}, -1.0) == std::vector<uint8_t>({0, 0}));
  CHECK(ScaleInts<int32_t>({1 << 30, -(1 << 30), 7, -7}, 4.0) ==
        std::vector<int32_t>({INT32_MAX, INT32_MIN, 28, -28}));
  CHECK(ScaleInts<int32_t>({INT32_MIN}, -1.0) == std::vector<int32_t>({INT32_MAX}));
  CHECK(ScaleInts<int32_t>({10, -10}, 0.29) == std::vector<int32_t>({2, -2}));
  const int64_t two62 = int64_t{1} << 62;
  const std::vector<int64_t> big = ScaleInts<int64_t>({two62, -two62, INT64_MAX, 5}, 4.0);
  CHECK_EQ(big[0], INT64_MAX);
  CHECK_EQ(big[1], INT64_MIN);
  CHECK_EQ(big[2], INT64_MAX);
  CHECK_EQ(big[3], int64_t{20});
  CHECK_EQ(ScaleInts<int64_t>({INT64_MIN}, -1.0)[0], INT64_MAX);
  CHECK_EQ(ScaleInts<int64_t>({two62}, 2.0)[0], INT64_MAX);  // exactly 2^63
  CHECK_EQ(ScaleInts<int64_t>({-two62}, 2.0)[0], INT64_MIN);  // exactly -2^63
}

TEST(Scale_FloatsRoundOnce) {
  std::vector<float> f = {1.0f, 3.0f, -0.0f};
  keras_ring::Scale(DataType::kFloat32, f.data(), f.size(), 0.1);
  CHECK_EQ(f[0], 0.1f);
  CHECK_EQ(f[1], static_cast<float>(3.0 * 0.1));
  CHECK(f[2] == 0.0f && std::signbit(f[2]));
  std::vector<uint16_t> h = {0x3C00, 0x7BFF, 0x0001};
  keras_ring::Scale(DataType::kFloat16, h.data(), h.size(), 2.0);
  CHECK_EQ(h[0], 0x4000);
  CHECK_EQ(h[1], 0x7C00);  // 131008 overflows to infinity
  CHECK_EQ(h[2], 0x0002);
  std::vector<uint16_t> b = {0x3F80, 0xBF80};
  keras_ring::Scale(DataType::kBFloat16, b.data(), b.size(), 0.5);
  CHECK_EQ(b[0], 0x3F00);
  CHECK_EQ(b[1], 0xBF00);
}

TEST(AverageScale_IntegersDivideExactlyOrScaleOnce) {
  std::vector<int32_t> v = {7, -7, 5, INT32_MIN};
  keras_ring::AverageScale(DataType::kInt32, v.data(), v.size(), 2, 1.0);
  CHECK(v == std::vector<int32_t>({3, -3, 2, INT32_MIN / 2}));
  // Scaled: one truncation of sum * factor / divisor, not (sum / divisor) * factor.
  std::vector<int8_t> w = {100, -100, 3};
  keras_ring::AverageScale(DataType::kInt8, w.data(), w.size(), 3, 3.0);
  CHECK(w == std::vector<int8_t>({100, -100, 3}));
  std::vector<int32_t> x = {7, -7, 1};
  keras_ring::AverageScale(DataType::kInt32, x.data(), x.size(), 2, 2.0);
  CHECK(x == std::vector<int32_t>({7, -7, 1}));
  std::vector<int16_t> y = {30000, -30000};
  keras_ring::AverageScale(DataType::kInt16, y.data(), y.size(), 2, 4.0);  // saturates
  CHECK(y == std::vector<int16_t>({32767, -32768}));
  std::vector<uint8_t> u = {255, 7};
  keras_ring::AverageScale(DataType::kUInt8, u.data(), u.size(), 8, 1.0);
  CHECK(u == std::vector<uint8_t>({31, 0}));
  std::vector<int64_t> l = {INT64_MAX, -9};
  keras_ring::AverageScale(DataType::kInt64, l.data(), l.size(), 4, 1.0);
  CHECK(l == std::vector<int64_t>({INT64_MAX / 4, -2}));
  std::vector<double> d = {3.0, 1.0};
  keras_ring::AverageScale(DataType::kFloat64, d.data(), d.size(), 2, 0.5);
  CHECK(d == std::vector<double>({0.75, 0.25}));
}

}  // namespace kr_test

namespace kr_test {
namespace {

using namespace keras_ring;  // NOLINT: test-local

// The float16 reduction may take a vectorised F16C path chosen at run time; it must give
// the same bits as the portable conversions for every op, over many random patterns
// (subnormals, infinities and NaNs included; NaNs only need to stay NaN).
TEST(Reduce_Float16VectorPathMatchesScalarConversions) {
  const size_t n = 4096 + 37;  // full 256-element blocks plus a tail
  std::vector<uint16_t> a(n), b(n);
  uint32_t state = 12345;
  for (size_t i = 0; i < n; ++i) {
    state = state * 1664525u + 1013904223u;
    a[i] = static_cast<uint16_t>(state >> 16);
    b[i] = static_cast<uint16_t>(state);
  }
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax}) {
    std::vector<uint16_t> out(n);
    Reduce(DataType::kFloat16, op, out.data(), a.data(), b.data(), n);
    int mismatches = 0;
    for (size_t i = 0; i < n; ++i) {
      const float x = HalfToFloat(a[i]), y = HalfToFloat(b[i]);
      float r = op == ReduceOp::kSum ? x + y : op == ReduceOp::kProduct ? x * y
              : op == ReduceOp::kMin ? ((x < y || x != x) ? x : y) : ((x > y || x != x) ? x : y);
      const uint16_t want = FloatToHalf(r);
      const bool both_nan = (want & 0x7c00u) == 0x7c00u && (want & 0x3ffu) &&
                            (out[i] & 0x7c00u) == 0x7c00u && (out[i] & 0x3ffu);
      if (out[i] != want && !both_nan) ++mismatches;
    }
    CHECK(mismatches == 0) << ReduceOpName(op) << ": " << mismatches << " of " << n;
  }
}

}  // namespace
}  // namespace kr_test
