// Type-erased reduction kernels used by the algorithms. Loops are written so the compiler
// vectorises them (restrict pointers, no branches in the float paths).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.h"

namespace keras_ring {

// dst[i] = dst[i] (op) src[i] for i < count. Average reduces like Sum; scaling is separate.
// Integer Sum and Product wrap around like the hardware does. Min/Max propagate NaN.
void Reduce(DataType dtype, ReduceOp op, void* dst, const void* src, size_t count);
// dst[i] = a[i] (op) b[i]; dst may be a (but not b). Lets the first ring step read the
// input tensor directly instead of copying it to the output first.
void Reduce(DataType dtype, ReduceOp op, void* dst, const void* a, const void* b, size_t count);

// buf[i] *= factor. Floats compute in double and round once; integers truncate toward
// zero and saturate at the type's limits.
void Scale(DataType dtype, void* buf, size_t count, double factor);

// Finishes an Average: multiplied by factor/divisor in double, rounded (floats) or truncated
// toward zero and saturated (integers) once; integers with factor 1 are divided exactly
// (truncating toward zero), which a double could not do beyond 2^53.
void AverageScale(DataType dtype, void* buf, size_t count, int64_t divisor, double factor);

// The one rule for what follows the reduction of `world` ranks' (prescaled) data: Average
// divides by `world`, then `postscale` multiplies (AverageScale), else only the postscale.
// The ring (on each rank's finished chunk) and the inline path (on the whole result) both
// end with it, so they agree bit for bit.
void FinishReduction(DataType dtype, ReduceOp op, void* buf, size_t count, int world,
                     double postscale);

// True if Reduce supports the pair (bool supports none).
bool IsReducible(DataType dtype);

// IEEE binary16 and bfloat16 conversions, round to nearest even.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

}  // namespace keras_ring
