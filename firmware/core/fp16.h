/*
 * IEEE binary16 conversions in integer code (no FP16 hardware needed), as the
 * accumulation buffer of protocol/SPEC.md section 4 requires.
 */
#ifndef QS_FP16_H
#define QS_FP16_H

#include <stdint.h>

#define QS_FP16_MAX_BITS 0x7BFFu /* 65504, the largest finite binary16 */

/*
 * float32 -> binary16 bits, round to nearest even, saturating to +-65504 (never
 * infinity, as numpy's clip followed by astype(float16)). NaN stays a quiet NaN.
 */
uint16_t qs_f16_from_f32(float value);

/* binary16 bits -> float32 (exact: every binary16 value is a float32 value). */
float qs_f16_to_f32(uint16_t half);

#endif
