#include "fp16.h"

#include <string.h>

static uint32_t f32_bits(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

static float f32_from_bits(uint32_t bits)
{
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Shift right by `shift` (1..31) with round to nearest, ties to even. */
static uint32_t shift_round_even(uint32_t value, uint32_t shift)
{
    const uint32_t kept = value >> shift;
    const uint32_t rest = value & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

uint16_t qs_f16_from_f32(float value)
{
    const uint32_t bits = f32_bits(value);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    const uint32_t mag = bits & 0x7FFFFFFFu;
    if (mag > 0x7F800000u) {
        return (uint16_t)(sign | 0x7E00u); /* NaN */
    }
    if (mag >= 0x477FE000u) {
        return (uint16_t)(sign | QS_FP16_MAX_BITS); /* >= 65504 (incl. inf): saturate */
    }
    const uint32_t exp = mag >> 23;
    const uint32_t mant = mag & 0x007FFFFFu;
    if (exp >= 113u) {
        /* Normal binary16: rebias 127 -> 15, keep 10 of 23 mantissa bits. A carry out
         * of the mantissa correctly bumps the exponent; it cannot reach infinity
         * because mag < 65504 + half an ulp was checked above. */
        const uint32_t half = ((exp - 112u) << 10) | (mant >> 13);
        const uint32_t rest = mant & 0x1FFFu;
        const uint32_t up = (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ? 1u : 0u;
        return (uint16_t)(sign | (half + up));
    }
    /* Subnormal binary16 (or zero): result = mant24 * 2^(exp - 150) / 2^-24, i.e.
     * mant24 >> (126 - exp); shift >= 14 here. A shift above 24 leaves less than half
     * of the smallest subnormal, which rounds to zero. */
    const uint32_t shift = 126u - exp;
    if (exp == 0u || shift > 24u) {
        return sign;
    }
    return (uint16_t)(sign | shift_round_even(mant | 0x00800000u, shift));
}

float qs_f16_to_f32(uint16_t half)
{
    const uint32_t sign = ((uint32_t)half & 0x8000u) << 16;
    uint32_t exp = ((uint32_t)half >> 10) & 0x1Fu;
    uint32_t mant = (uint32_t)half & 0x03FFu;
    if (exp == 0x1Fu) {
        return f32_from_bits(sign | 0x7F800000u | (mant << 13));
    }
    if (exp == 0u) {
        if (mant == 0u) {
            return f32_from_bits(sign);
        }
        /* Normalise the subnormal: value = mant * 2^-24. */
        exp = 113u;
        while ((mant & 0x0400u) == 0u) {
            mant <<= 1;
            --exp;
        }
        mant &= 0x03FFu;
        return f32_from_bits(sign | (exp << 23) | (mant << 13));
    }
    return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}
