/*
 * Fixed-point requantisation with TFLite's semantics (gemmlowp's
 * SaturatingRoundingDoublingHighMul and RoundingDivideByPOT, double rounding), so an
 * int8 forward pass is bit-identical to TFLite's reference integer kernels.
 */
#ifndef QS_QUANT_H
#define QS_QUANT_H

#include <stdint.h>

/* round(a * b / 2^31), saturating the one overflow case a = b = INT32_MIN. */
static inline int32_t qs_srdhm(int32_t a, int32_t b)
{
    if (a == INT32_MIN && b == INT32_MIN) {
        return INT32_MAX;
    }
    const int64_t ab = (int64_t)a * (int64_t)b;
    const int64_t nudge = ab >= 0 ? (1ll << 30) : (1ll - (1ll << 30));
    /* C division truncates toward zero, as gemmlowp relies on. |ab| <= 2^62. */
    return (int32_t)((ab + nudge) / (1ll << 31));
}

/* x / 2^exponent rounded to nearest, ties away from zero; exponent in [0, 31]. */
static inline int32_t qs_rdbpot(int32_t x, int32_t exponent)
{
    const int32_t mask = (int32_t)((1ll << exponent) - 1);
    const int32_t remainder = x & mask;
    const int32_t threshold = (mask >> 1) + (x < 0 ? 1 : 0);
    /* >> of a negative int32 is an arithmetic shift on every compiler we target. */
    return (x >> exponent) + (remainder > threshold ? 1 : 0);
}

/*
 * TFLite's MultiplyByQuantizedMultiplier: x * multiplier * 2^shift, multiplier a Q31
 * value in [2^30, 2^31) and shift in [-31, 30] (checked by Prepare). A positive shift
 * is applied before the multiply with int32 wrap-around, as TFLite's int32 code does;
 * Prepare keeps left shifts small enough for real models.
 */
static inline int32_t qs_mbqm(int32_t x, int32_t multiplier, int32_t shift)
{
    const int32_t left = shift > 0 ? shift : 0;
    const int32_t right = shift > 0 ? 0 : -shift;
    const int32_t shifted = (int32_t)((uint32_t)x << left);
    return qs_rdbpot(qs_srdhm(shifted, multiplier), right);
}

/*
 * The TFLITE_SINGLE_ROUNDING variant: round(x * multiplier / 2^(31 - shift)) in one
 * step, shift clamped to <= 30 as TFLite does. |x * multiplier| <= 2^62 and the
 * rounding term is at most 2^61, so the int64 sum cannot overflow. The result can
 * exceed int32 only for multipliers far above 1; callers clamp in int64.
 */
static inline int64_t qs_mbqm_single(int32_t x, int32_t multiplier, int32_t shift)
{
    if (shift > 30) {
        multiplier = INT32_MAX;
        shift = 30;
    }
    const int32_t total = 31 - shift; /* in [1, 62]: Prepare keeps shift >= -31 */
    const int64_t sum = (int64_t)x * multiplier + ((int64_t)1 << (total - 1));
    return sum >> total; /* arithmetic shift: floor, as numpy's >> on int64 */
}

/* Either rounding variant, widened to int64. */
static inline int64_t qs_requantize(int32_t x, int32_t multiplier, int32_t shift, int single_rounding)
{
    return single_rounding ? qs_mbqm_single(x, multiplier, shift) : (int64_t)qs_mbqm(x, multiplier, shift);
}

static inline int32_t qs_clamp(int32_t v, int32_t lo, int32_t hi)
{
    return v < lo ? lo : (v > hi ? hi : v);
}

#endif
