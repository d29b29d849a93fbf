#include "reduce.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace keras_ring {

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {  // Inf or NaN
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {  // normal
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {  // zero
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) {  // Inf or NaN (keep NaN quiet)
    return sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u);
  }
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: overflow to Inf
  if (x < 0x38800000u) {                         // result is subnormal or zero
    if (x < 0x33000000u) return sign;            // < half the smallest subnormal
    const uint32_t e = x >> 23;
    uint32_t mant = (x & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t result = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (result & 1u))) ++result;
    return sign | static_cast<uint16_t>(result);
  }
  // Normal: rebias exponent, round mantissa to 10 bits (carry may bump the exponent).
  uint32_t result = ((x >> 13) - (112u << 10));
  const uint32_t rem = x & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (result & 1u))) ++result;
  return sign | static_cast<uint16_t>(result);
}

float BFloat16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t FloatToBFloat16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

namespace {

// Integer arithmetic goes through the unsigned type so overflow wraps instead of being UB.
template <typename T>
inline T WrapAdd(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
}
template <typename T>
inline T WrapMul(T a, T b) {
  using U = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;
  return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
}

template <typename T>
inline T Max(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    return (a > b || a != a) ? a : b;  // NaN in either operand wins
  } else {
    return a > b ? a : b;
  }
}
template <typename T>
inline T Min(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    return (a < b || a != a) ? a : b;
  } else {
    return a < b ? a : b;
  }
}

// dst[i] = a[i] (op) b[i]. dst may alias a (the compiler versions the loop for that).
template <typename T>
void ReduceTyped(ReduceOp op, T* dst, const T* a, const T* __restrict b, size_t n) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAverage:
      if constexpr (std::is_floating_point_v<T>) {
        for (size_t i = 0; i < n; ++i) dst[i] = a[i] + b[i];
      } else {
        for (size_t i = 0; i < n; ++i) dst[i] = WrapAdd(a[i], b[i]);
      }
      break;
    case ReduceOp::kProduct:
      if constexpr (std::is_floating_point_v<T>) {
        for (size_t i = 0; i < n; ++i) dst[i] = a[i] * b[i];
      } else {
        for (size_t i = 0; i < n; ++i) dst[i] = WrapMul(a[i], b[i]);
      }
      break;
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) dst[i] = Min(a[i], b[i]);
      break;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) dst[i] = Max(a[i], b[i]);
      break;
  }
}

// 16-bit floats reduce through float32 in blocks, so the float loop stays vectorisable.
template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void Reduce16(ReduceOp op, uint16_t* dst, const uint16_t* a, const uint16_t* b, size_t n) {
  constexpr size_t kBlock = 256;
  float fa[kBlock], fb[kBlock];
  for (size_t off = 0; off < n; off += kBlock) {
    const size_t m = n - off < kBlock ? n - off : kBlock;
    for (size_t i = 0; i < m; ++i) {
      fa[i] = ToF(a[off + i]);
      fb[i] = ToF(b[off + i]);
    }
    ReduceTyped<float>(op, fa, fa, fb, m);
    for (size_t i = 0; i < m; ++i) dst[off + i] = FromF(fa[i]);
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KR_HAVE_F16C_PATH 1
// float16 through float32 with the F16C conversion instructions, 8 lanes at a time. Picked
// at run time, so one build serves CPUs with and without them. Rounding is to nearest
// even, like FloatToHalf.
__attribute__((target("avx2,f16c"))) void Reduce16F16C(ReduceOp op, uint16_t* dst,
                                                       const uint16_t* a, const uint16_t* b,
                                                       size_t n) {
  constexpr size_t kBlock = 256;
  alignas(32) float fa[kBlock];
  alignas(32) float fb[kBlock];
  size_t off = 0;
  for (; off + kBlock <= n; off += kBlock) {
    for (size_t i = 0; i < kBlock; i += 8) {
      _mm256_store_ps(fa + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(a + off + i))));
      _mm256_store_ps(fb + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(b + off + i))));
    }
    ReduceTyped<float>(op, fa, fa, fb, kBlock);
    for (size_t i = 0; i < kBlock; i += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + off + i),
                       _mm256_cvtps_ph(_mm256_load_ps(fa + i), _MM_FROUND_TO_NEAREST_INT));
    }
  }
  if (off < n) Reduce16<HalfToFloat, FloatToHalf>(op, dst + off, a + off, b + off, n - off);
}

bool CpuHasF16C() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}
#endif

template <typename T>
void ScaleTyped(T* buf, size_t n, double factor) {
  if constexpr (std::is_floating_point_v<T>) {
    for (size_t i = 0; i < n; ++i) buf[i] = static_cast<T>(static_cast<double>(buf[i]) * factor);
  } else {
    constexpr double lo = static_cast<double>(std::numeric_limits<T>::min());
    constexpr double hi = static_cast<double>(std::numeric_limits<T>::max());
    for (size_t i = 0; i < n; ++i) {
      const double v = std::trunc(static_cast<double>(buf[i]) * factor);
      // For int64, hi rounds up to 2^63, which does not fit: saturate at >=, never cast it.
      buf[i] = v != v   ? T(0)  // a NaN factor: no defined integer; never cast NaN
               : v <= lo ? std::numeric_limits<T>::min()
                       : (v >= hi ? std::numeric_limits<T>::max() : static_cast<T>(v));
    }
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void Scale16(uint16_t* buf, size_t n, double factor) {
  for (size_t i = 0; i < n; ++i) {
    buf[i] = FromF(static_cast<float>(static_cast<double>(ToF(buf[i])) * factor));
  }
}

template <typename T>
void DivideTyped(T* buf, size_t n, int64_t divisor) {
  const T d = static_cast<T>(divisor);
  for (size_t i = 0; i < n; ++i) buf[i] = static_cast<T>(buf[i] / d);
}

bool IsInteger(DataType t) {
  return t == DataType::kInt8 || t == DataType::kUInt8 || t == DataType::kInt16 ||
         t == DataType::kUInt16 || t == DataType::kInt32 || t == DataType::kInt64;
}

}  // namespace

void AverageScale(DataType dtype, void* buf, size_t count, int64_t divisor, double factor) {
  // Floats, and scaled integers: one multiplication by factor/divisor, truncated once (as
  // Horovod does; dividing first and scaling after truncated twice: 7 / 2 * 2 gave 6).
  if (!IsInteger(dtype) || factor != 1.0) {
    Scale(dtype, buf, count, factor / static_cast<double>(divisor));
    return;
  }
  if (divisor != 1) {
    switch (dtype) {
      case DataType::kInt8: DivideTyped(static_cast<int8_t*>(buf), count, divisor); break;
      case DataType::kUInt8: DivideTyped(static_cast<uint8_t*>(buf), count, divisor); break;
      case DataType::kInt16: DivideTyped(static_cast<int16_t*>(buf), count, divisor); break;
      case DataType::kUInt16: DivideTyped(static_cast<uint16_t*>(buf), count, divisor); break;
      case DataType::kInt32: DivideTyped(static_cast<int32_t*>(buf), count, divisor); break;
      case DataType::kInt64: DivideTyped(static_cast<int64_t*>(buf), count, divisor); break;
      default: break;
    }
  }
}

void FinishReduction(DataType dtype, ReduceOp op, void* buf, size_t count, int world,
                     double postscale) {
  if (op == ReduceOp::kAverage) {
    AverageScale(dtype, buf, count, world, postscale);
  } else {
    Scale(dtype, buf, count, postscale);
  }
}

bool IsReducible(DataType dtype) { return dtype != DataType::kBool; }

void Reduce(DataType dtype, ReduceOp op, void* dst, const void* src, size_t count) {
  Reduce(dtype, op, dst, dst, src, count);
}

void Reduce(DataType dtype, ReduceOp op, void* dst, const void* a, const void* b, size_t count) {
#define KR_REDUCE_CASE(DT, T)                                                        \
  case DT:                                                                           \
    ReduceTyped(op, static_cast<T*>(dst), static_cast<const T*>(a),                  \
                static_cast<const T*>(b), count);                                    \
    break;
  switch (dtype) {
    case DataType::kFloat16:
#ifdef KR_HAVE_F16C_PATH
      if (CpuHasF16C()) {
        Reduce16F16C(op, static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(a),
                     static_cast<const uint16_t*>(b), count);
        break;
      }
#endif
      Reduce16<HalfToFloat, FloatToHalf>(op, static_cast<uint16_t*>(dst),
                                         static_cast<const uint16_t*>(a),
                                         static_cast<const uint16_t*>(b), count);
      break;
    case DataType::kBFloat16:
      Reduce16<BFloat16ToFloat, FloatToBFloat16>(op, static_cast<uint16_t*>(dst),
                                                 static_cast<const uint16_t*>(a),
                                                 static_cast<const uint16_t*>(b), count);
      break;
    KR_REDUCE_CASE(DataType::kFloat32, float)
    KR_REDUCE_CASE(DataType::kFloat64, double)
    KR_REDUCE_CASE(DataType::kInt8, int8_t)
    KR_REDUCE_CASE(DataType::kUInt8, uint8_t)
    KR_REDUCE_CASE(DataType::kInt16, int16_t)
    KR_REDUCE_CASE(DataType::kUInt16, uint16_t)
    KR_REDUCE_CASE(DataType::kInt32, int32_t)
    KR_REDUCE_CASE(DataType::kInt64, int64_t)
    case DataType::kBool:
      break;
  }
#undef KR_REDUCE_CASE
}

void Scale(DataType dtype, void* buf, size_t count, double factor) {
  if (factor == 1.0) return;
  switch (dtype) {
    case DataType::kFloat16:
      Scale16<HalfToFloat, FloatToHalf>(static_cast<uint16_t*>(buf), count, factor);
      break;
    case DataType::kBFloat16:
      Scale16<BFloat16ToFloat, FloatToBFloat16>(static_cast<uint16_t*>(buf), count, factor);
      break;
    case DataType::kFloat32: ScaleTyped(static_cast<float*>(buf), count, factor); break;
    case DataType::kFloat64: ScaleTyped(static_cast<double*>(buf), count, factor); break;
    case DataType::kInt8: ScaleTyped(static_cast<int8_t*>(buf), count, factor); break;
    case DataType::kUInt8: ScaleTyped(static_cast<uint8_t*>(buf), count, factor); break;
    case DataType::kInt16: ScaleTyped(static_cast<int16_t*>(buf), count, factor); break;
    case DataType::kUInt16: ScaleTyped(static_cast<uint16_t*>(buf), count, factor); break;
    case DataType::kInt32: ScaleTyped(static_cast<int32_t*>(buf), count, factor); break;
    case DataType::kInt64: ScaleTyped(static_cast<int64_t*>(buf), count, factor); break;
    case DataType::kBool: break;
  }
}

}  // namespace keras_ring
