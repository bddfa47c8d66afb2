#include "update.h"

#include <string.h>

#include "crc32.h"
#include "fp16.h"
#include "prng.h"

#define CRC_CHUNK_BYTES 64u /* values are serialised little-endian through this buffer */

/* Is z_k = -1 at flat index i, given the Philox words of i's block? */
static int negative_at(const uint32_t bits[4], uint32_t i)
{
    const uint32_t r = i % QS_PERTURB_BLOCK;
    return (int)((bits[r >> 5] >> (r & 31u)) & 1u);
}

qs_status qs_pairs_check(const qs_pair *pairs, uint32_t count)
{
    for (uint32_t p = 1; p < count; ++p) {
        if (pairs[p].k <= pairs[p - 1].k) {
            return QS_ERR_ORDER;
        }
    }
    return QS_OK;
}

static int32_t clamp_weight(int32_t v)
{
    if (v > QS_INT8_WEIGHT_MAX) {
        return QS_INT8_WEIGHT_MAX;
    }
    if (v < -QS_INT8_WEIGHT_MAX) {
        return -QS_INT8_WEIGHT_MAX;
    }
    return v;
}

/* Is [first, first + count) inside the uint32 flat index space? */
static int range_ok(uint32_t first, uint32_t count)
{
    return count <= UINT32_MAX - first;
}

qs_status qs_perturb_int8(const int8_t *w, int8_t *out, uint32_t count, uint32_t first,
                          qs_stream stream, uint32_t k, int32_t eps, int32_t sign)
{
    if ((sign != 1 && sign != -1) || eps <= 0 || eps > QS_INT8_WEIGHT_MAX || !range_ok(first, count)) {
        return QS_ERR_ARG;
    }
    const int32_t step = eps * sign; /* |step| <= 127, so w + step fits easily in int32 */
    uint32_t bits[4];
    for (uint32_t j = 0; j < count; ++j) {
        const uint32_t i = first + j;
        if (j == 0u || i % QS_PERTURB_BLOCK == 0u) {
            qs_perturb_bits(stream.seed, stream.step, k, i / QS_PERTURB_BLOCK, bits);
        }
        const int32_t move = negative_at(bits, i) ? -step : step;
        out[j] = (int8_t)clamp_weight((int32_t)w[j] + move);
    }
    return QS_OK;
}

qs_status qs_perturb_f32(const float *theta, float *out, uint32_t count, uint32_t first,
                         qs_stream stream, uint32_t k, float eps, int32_t sign)
{
    if ((sign != 1 && sign != -1) || !range_ok(first, count)) {
        return QS_ERR_ARG;
    }
    const float step = eps * (float)sign; /* exact: a sign change */
    uint32_t bits[4];
    for (uint32_t j = 0; j < count; ++j) {
        const uint32_t i = first + j;
        if (j == 0u || i % QS_PERTURB_BLOCK == 0u) {
            qs_perturb_bits(stream.seed, stream.step, k, i / QS_PERTURB_BLOCK, bits);
        }
        out[j] = theta[j] + (negative_at(bits, i) ? -step : step);
    }
    return QS_OK;
}

/*
 * delta[r] = sum over pairs (ascending k) of +-c for the elements [lo, hi) of one
 * Philox block. One block of deltas lives on the stack (QS_PERTURB_BLOCK floats), so
 * no buffer proportional to the model is needed.
 */
static void block_delta(float delta[QS_PERTURB_BLOCK], uint32_t block, uint32_t lo, uint32_t hi,
                        qs_stream stream, const qs_pair *pairs, uint32_t npairs)
{
    uint32_t bits[4];
    for (uint32_t r = lo; r < hi; ++r) {
        delta[r] = 0.0f;
    }
    for (uint32_t p = 0; p < npairs; ++p) {
        const float c = pairs[p].c;
        qs_perturb_bits(stream.seed, stream.step, pairs[p].k, block, bits);
        for (uint32_t r = lo; r < hi; ++r) {
            /* z = +-1 makes c*z exact; only this float32 add rounds (SPEC order). */
            delta[r] = delta[r] + (((bits[r >> 5] >> (r & 31u)) & 1u) ? -c : c);
        }
    }
}

/* Calls visit(first_j, lo, hi, block) for each Philox block overlapping the range. */
#define FOR_EACH_BLOCK(first, count, BODY)                                                     \
    do {                                                                                       \
        uint32_t j_ = 0;                                                                       \
        while (j_ < (count)) {                                                                 \
            const uint32_t i_ = (first) + j_;                                                  \
            const uint32_t block = i_ / QS_PERTURB_BLOCK;                                      \
            const uint32_t lo = i_ % QS_PERTURB_BLOCK;                                         \
            uint32_t hi = QS_PERTURB_BLOCK;                                                    \
            if ((count) - j_ < hi - lo) {                                                      \
                hi = lo + ((count) - j_);                                                      \
            }                                                                                  \
            const uint32_t base = j_ - lo; /* index into the buffer of block offset 0 */       \
            BODY;                                                                              \
            j_ += hi - lo;                                                                     \
        }                                                                                      \
    } while (0)

qs_status qs_apply_f32(float *theta, uint32_t count, uint32_t first, qs_stream stream,
                       const qs_pair *pairs, uint32_t npairs)
{
    if (!range_ok(first, count)) {
        return QS_ERR_ARG;
    }
    qs_status st = qs_pairs_check(pairs, npairs);
    if (st != QS_OK) {
        return st;
    }
    float delta[QS_PERTURB_BLOCK];
    FOR_EACH_BLOCK(first, count, {
        block_delta(delta, block, lo, hi, stream, pairs, npairs);
        for (uint32_t r = lo; r < hi; ++r) {
            theta[base + r] = theta[base + r] + delta[r];
        }
    });
    return QS_OK;
}

qs_status qs_apply_int8_fp16(int8_t *w, uint16_t *buf, uint32_t count, uint32_t first,
                             qs_stream stream, const qs_pair *pairs, uint32_t npairs)
{
    if (!range_ok(first, count)) {
        return QS_ERR_ARG;
    }
    qs_status st = qs_pairs_check(pairs, npairs);
    if (st != QS_OK) {
        return st;
    }
    float delta[QS_PERTURB_BLOCK];
    FOR_EACH_BLOCK(first, count, {
        block_delta(delta, block, lo, hi, stream, pairs, npairs);
        for (uint32_t r = lo; r < hi; ++r) {
            const uint32_t j = base + r;
            const uint16_t summed = qs_f16_from_f32(qs_f16_to_f32(buf[j]) + delta[r]);
            const float b = qs_f16_to_f32(summed);
            /* |b| <= 65504 (saturated, and NaN cannot arise from finite c), so the
             * truncating conversion is defined and m fits int32. */
            const int32_t m = (b != b) ? 0 : (int32_t)b;
            w[j] = (int8_t)clamp_weight((int32_t)w[j] + m);
            /* b - m drops the integer bits of b: exact in float32 and in binary16. */
            buf[j] = qs_f16_from_f32(b - (float)m);
        }
    });
    return QS_OK;
}

uint32_t qs_crc32_fp16(uint32_t crc, const uint16_t *buf, uint32_t count)
{
    uint8_t chunk[CRC_CHUNK_BYTES];
    uint32_t used = 0;
    for (uint32_t j = 0; j < count; ++j) {
        chunk[used++] = (uint8_t)(buf[j] & 0xFFu);
        chunk[used++] = (uint8_t)(buf[j] >> 8);
        if (used == sizeof chunk) {
            crc = qs_crc32_update(crc, chunk, used);
            used = 0;
        }
    }
    return qs_crc32_update(crc, chunk, used);
}

uint32_t qs_crc32_f32(uint32_t crc, const float *theta, uint32_t count)
{
    uint8_t chunk[CRC_CHUNK_BYTES];
    uint32_t used = 0;
    for (uint32_t j = 0; j < count; ++j) {
        uint32_t bits;
        memcpy(&bits, &theta[j], sizeof bits);
        for (int b = 0; b < 4; ++b) {
            chunk[used++] = (uint8_t)(bits >> (8 * b));
        }
        if (used == sizeof chunk) {
            crc = qs_crc32_update(crc, chunk, used);
            used = 0;
        }
    }
    return qs_crc32_update(crc, chunk, used);
}
