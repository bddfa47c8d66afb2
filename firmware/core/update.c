#include "update.h"

#include <float.h>
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

float qs_channel_gain(float scale)
{
    const double square = (double)scale * (double)scale;
    if (!(square > 0.0)) {
        return 0.0f;
    }
    const double quotient = 1.0 / square;
    return quotient > (double)FLT_MAX ? FLT_MAX : (float)quotient;
}

/* Multiplies delta[lo, hi) by the gains of tensor elements base + lo .. base + hi
 * (count elements in all); the last channel's gain is kept, as runs share it. */
static void apply_gain(float delta[QS_PERTURB_BLOCK], uint32_t lo, uint32_t hi, uint32_t base, uint32_t count,
                       const qs_gain *g, uint32_t *cached_channel, float *cached_gain)
{
    const uint32_t run = g->channel_minor ? 1u : count / g->channels;
    for (uint32_t r = lo; r < hi; ++r) {
        const uint32_t j = base + r;
        const uint32_t c = g->channel_minor ? j % g->channels : j / run;
        if (c != *cached_channel) {
            *cached_channel = c;
            *cached_gain = qs_channel_gain(g->scales[c]);
        }
        delta[r] = delta[r] * *cached_gain;
    }
}

/* A gain fits a tensor of count elements: channels divide it (or repeat in it). */
static int gain_ok(const qs_gain *g, uint32_t count)
{
    return g == NULL || (g->scales != NULL && g->channels != 0u && count % g->channels == 0u);
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
                             qs_stream stream, const qs_pair *pairs, uint32_t npairs, const qs_gain *gain)
{
    if (!range_ok(first, count) || !gain_ok(gain, count)) {
        return QS_ERR_ARG;
    }
    qs_status st = qs_pairs_check(pairs, npairs);
    if (st != QS_OK) {
        return st;
    }
    float delta[QS_PERTURB_BLOCK];
    uint32_t channel = UINT32_MAX;
    float channel_gain = 0.0f;
    FOR_EACH_BLOCK(first, count, {
        block_delta(delta, block, lo, hi, stream, pairs, npairs);
        if (gain != NULL) {
            apply_gain(delta, lo, hi, base, count, gain, &channel, &channel_gain);
        }
        for (uint32_t r = lo; r < hi; ++r) {
            const uint32_t j = base + r;
            const uint16_t summed = qs_f16_from_f32(qs_f16_to_f32(buf[j]) + delta[r]);
            const float b = qs_f16_to_f32(summed);
            /* |b| <= 65504 (saturated, and NaN cannot arise from finite c), so the
             * truncating conversion is defined and m fits int32. */
            const int32_t m = (b != b) ? 0 : (int32_t)b;
            w[j] = (int8_t)clamp_weight((int32_t)w[j] + m);
            /* b - m drops the integer bits of b: exact in float32 and in binary16. A zero
             * remainder is +0 (SPEC 4.2: b - trunc(b)); b - 0 would keep b = -0.0. */
            const float rest = b - (float)m;
            buf[j] = qs_f16_from_f32(rest == 0.0f ? 0.0f : rest);
        }
    });
    return QS_OK;
}

int32_t qs_recal_exp_limit(int32_t mult, int32_t shift)
{
    const int32_t room = QS_RECAL_SHIFT_MAX - shift;
    if (mult == 0 || room <= 0) {
        return 0;
    }
    return room < QS_RECAL_EXP_MAX ? room : QS_RECAL_EXP_MAX;
}

/* Element i of channel c: channel-minor tensors interleave their channels. */
static uint32_t channel_element(uint32_t c, uint32_t i, uint32_t channels, uint32_t per_channel, int channel_minor)
{
    return channel_minor ? c + i * channels : c * per_channel + i;
}

uint32_t qs_recalibrate_fp16(int8_t *w, uint16_t *buf, uint32_t count, uint32_t channels, int channel_minor,
                             int8_t *exps, const int32_t *mult, const int32_t *shift)
{
    if (channels == 0u || count % channels != 0u) {
        return 0;
    }
    const uint32_t per_channel = count / channels;
    uint32_t grown = 0;
    for (uint32_t c = 0; c < channels; ++c) {
        int32_t peak = 0;
        for (uint32_t i = 0; i < per_channel; ++i) {
            const int32_t v = w[channel_element(c, i, channels, per_channel, channel_minor)];
            const int32_t magnitude = v < 0 ? -v : v;
            peak = magnitude > peak ? magnitude : peak;
        }
        if (peak < QS_INT8_WEIGHT_MAX || exps[c] >= qs_recal_exp_limit(mult[c], shift[c])) {
            continue;
        }
        for (uint32_t i = 0; i < per_channel; ++i) {
            const uint32_t j = channel_element(c, i, channels, per_channel, channel_minor);
            const int32_t half = w[j] / 2; /* C division truncates toward zero */
            /* b / 2 and the half step are exact in float32: one rounding, to binary16. */
            const float carried = (float)(w[j] - 2 * half) * 0.5f;
            buf[j] = qs_f16_from_f32(qs_f16_to_f32(buf[j]) * 0.5f + carried);
            w[j] = (int8_t)half;
        }
        exps[c] = (int8_t)(exps[c] + 1);
        ++grown;
    }
    return grown;
}

/*
 * rint of a float32 with |x| <= 2^24 (nearest, ties to even), in integer code: the
 * result is exact, as the default rounding mode's rint is, with no libm involved.
 */
static int32_t rint_bounded(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const int negative = (bits >> 31) != 0u;
    const uint32_t exp = (bits >> 23) & 0xFFu;
    const uint32_t mant = (bits & 0x007FFFFFu) | 0x00800000u;
    uint32_t mag;
    if (exp < 126u) {
        mag = 0; /* |x| < 0.5 (zero and subnormals included) */
    } else if (exp >= 150u) {
        mag = mant << (exp - 150u); /* already an integer; exp <= 151 since |x| <= 2^24 */
    } else {
        const uint32_t shift = 150u - exp; /* 1..24 */
        const uint32_t kept = mant >> shift;
        const uint32_t rest = mant & ((1u << shift) - 1u);
        const uint32_t half = 1u << (shift - 1u);
        mag = kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
    }
    return negative ? -(int32_t)mag : (int32_t)mag;
}

static float pow2f(int32_t e)
{
    const uint32_t bits = (uint32_t)(e + 127) << 23; /* e in [7, 15]: a normal float */
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static int32_t clamp_buffer(int32_t v)
{
    return v > 127 ? 127 : (v < -127 ? -127 : v);
}

/* One tensor's elements [first, first + count) with shift sigma. */
static void apply_acc8_tensor(int8_t *w, int8_t *buf, uint32_t count, uint32_t first, int32_t sigma,
                              qs_stream stream, const qs_pair *pairs, uint32_t npairs, const qs_gain *gain)
{
    float delta[QS_PERTURB_BLOCK];
    const float scale = pow2f(sigma);
    uint32_t channel = UINT32_MAX;
    float channel_gain = 0.0f;
    FOR_EACH_BLOCK(first, count, {
        block_delta(delta, block, lo, hi, stream, pairs, npairs);
        if (gain != NULL) {
            apply_gain(delta, lo, hi, base, count, gain, &channel, &channel_gain);
        }
        for (uint32_t r = lo; r < hi; ++r) {
            const uint32_t j = base + r;
            /* delta * 2^sigma is exact in float32 (or overflows to inf, clamped away). */
            float u = delta[r] * scale;
            u = u > 16777216.0f ? 16777216.0f : (u < -16777216.0f ? -16777216.0f : u);
            const int32_t acc = (int32_t)buf[j] + rint_bounded(u); /* |acc| <= 2^24 + 127 */
            const int32_t mag = (acc < 0 ? -acc : acc) >> sigma;
            const int32_t m = acc < 0 ? -mag : mag;
            w[j] = (int8_t)clamp_weight((int32_t)w[j] + m);
            buf[j] = (int8_t)clamp_buffer(acc - m * (1 << sigma));
        }
    });
}

/* Coarsen a tensor whose buffer saturates, refine one whose buffer stays small. */
static void rescale_tensor(int8_t *buf, uint32_t count, int8_t *shift)
{
    uint32_t saturated = 0;
    int32_t largest = 0;
    for (uint32_t j = 0; j < count; ++j) {
        const int32_t v = buf[j] < 0 ? -buf[j] : buf[j];
        saturated += v == 127;
        largest = v > largest ? v : largest;
    }
    if ((uint64_t)saturated * QS_ACC8_SATURATION_DIVISOR > count && *shift > QS_ACC8_SHIFT_MIN) {
        --*shift;
        for (uint32_t j = 0; j < count; ++j) {
            const int32_t v = buf[j] < 0 ? -buf[j] : buf[j];
            buf[j] = (int8_t)(buf[j] < 0 ? -((v + 1) >> 1) : ((v + 1) >> 1));
        }
    } else if (count != 0u && largest < 64 && *shift < QS_ACC8_SHIFT_MAX) {
        ++*shift;
        for (uint32_t j = 0; j < count; ++j) {
            buf[j] = (int8_t)(buf[j] * 2);
        }
    }
}

qs_status qs_apply_int8_acc8(int8_t *w, int8_t *buf, int8_t *shifts, const uint32_t *tensor_sizes,
                             uint32_t ntensors, qs_stream stream, const qs_pair *pairs, uint32_t npairs,
                             const qs_gain *gains)
{
    uint64_t total = 0;
    for (uint32_t t = 0; t < ntensors; ++t) {
        total += tensor_sizes[t];
        if (shifts[t] < QS_ACC8_SHIFT_MIN || shifts[t] > QS_ACC8_SHIFT_MAX ||
            !gain_ok(gains == NULL ? NULL : &gains[t], tensor_sizes[t])) {
            return QS_ERR_ARG;
        }
    }
    if (total > UINT32_MAX) {
        return QS_ERR_ARG;
    }
    const qs_status st = qs_pairs_check(pairs, npairs);
    if (st != QS_OK) {
        return st;
    }
    uint32_t start = 0;
    for (uint32_t t = 0; t < ntensors; ++t) {
        apply_acc8_tensor(w + start, buf + start, tensor_sizes[t], start, shifts[t], stream, pairs, npairs,
                          gains == NULL ? NULL : &gains[t]);
        start += tensor_sizes[t];
    }
    if ((stream.step + 1u) % QS_ACC8_RESCALE_EVERY == 0u) {
        start = 0;
        for (uint32_t t = 0; t < ntensors; ++t) {
            rescale_tensor(buf + start, tensor_sizes[t], &shifts[t]);
            start += tensor_sizes[t];
        }
    }
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
