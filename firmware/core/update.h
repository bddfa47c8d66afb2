/*
 * Perturbation and update arithmetic over the flat trainable vector
 * (protocol/SPEC.md sections 2-5), bit for bit as qsched.zo.update.
 *
 * The flat vector may live in several buffers (one per tensor), so every function
 * takes `first`, the flat index of the buffer's element 0: z_k depends on the flat
 * index, not on where the element is stored.
 */
#ifndef QS_UPDATE_H
#define QS_UPDATE_H

#include <stdint.h>

#include "qs_status.h"

#define QS_INT8_WEIGHT_MAX 127 /* symmetric int8 weights: -128 is never used */

/* One update coefficient c_k for perturbation k. */
typedef struct {
    uint32_t k;
    float c;
} qs_pair;

/* The (seed, step) a perturbation or update belongs to. */
typedef struct {
    uint64_t seed;
    uint32_t step;
} qs_stream;

/* QS_OK when k is strictly ascending (the wire order), else QS_ERR_ORDER. */
qs_status qs_pairs_check(const qs_pair *pairs, uint32_t count);

/* out[j] = clamp(w[j] + sign*eps*z_k[first+j], -127, 127); out may alias w.
 * Returns QS_ERR_ARG unless sign is +1 or -1 and 0 < eps <= 127. */
qs_status qs_perturb_int8(const int8_t *w, int8_t *out, uint32_t count, uint32_t first,
                          qs_stream stream, uint32_t k, int32_t eps, int32_t sign);

/* out[j] = theta[j] + (sign*eps)*z_k[first+j] in float32; out may alias theta. */
qs_status qs_perturb_f32(const float *theta, float *out, uint32_t count, uint32_t first,
                         qs_stream stream, uint32_t k, float eps, int32_t sign);

/*
 * The channel gains of one trainable tensor (SPEC 4.2, lr_unit "weight"): element j of
 * the tensor is in channel j mod channels (channel_minor: depthwise 1HWC) or j div
 * (count / channels), and its delta is multiplied by qs_channel_gain(scales[channel]).
 * A NULL gain pointer (lr_unit "int8_step") multiplies by nothing.
 */
typedef struct {
    const float *scales; /* the blob's per-channel float32 weight scales */
    uint32_t channels;
    uint32_t channel_minor;
} qs_gain;

/* (float)(1 / (s * s)) in double; 0 when s * s is not positive, FLT_MAX above it. */
float qs_channel_gain(float scale);

/* theta += sum_k c_k z_k, summed per element in ascending k (SPEC section 4). */
qs_status qs_apply_f32(float *theta, uint32_t count, uint32_t first, qs_stream stream,
                       const qs_pair *pairs, uint32_t npairs);

/* INT8 weights with the FP16 accumulation buffer (binary16 bits), SPEC section 4. With
 * a gain, w and buf hold exactly one tensor (count elements) of the flat vector. */
qs_status qs_apply_int8_fp16(int8_t *w, uint16_t *buf, uint32_t count, uint32_t first,
                             qs_stream stream, const qs_pair *pairs, uint32_t npairs, const qs_gain *gain);

/*
 * The INT8 accumulation buffer (SPEC "INT8 accumulation buffer", qsched.zo.accum_int8):
 * an int8 buffer per element and a power-of-two shift sigma_t in [7, 15] per tensor of
 * the flat vector. tensor_sizes[t] elements belong to tensor t, in order; w, buf span
 * all of them (flat indices from 0). Rescales after the update when (step + 1) is a
 * multiple of QS_ACC8_RESCALE_EVERY. QS_ERR_ARG for a shift outside [7, 15]. gains: one
 * per tensor, or NULL (lr_unit "int8_step").
 */
#define QS_ACC8_SHIFT_MIN 7
#define QS_ACC8_SHIFT_MAX 15
#define QS_ACC8_RESCALE_EVERY 16u
#define QS_ACC8_SATURATION_DIVISOR 64u
qs_status qs_apply_int8_acc8(int8_t *w, int8_t *buf, int8_t *shifts, const uint32_t *tensor_sizes,
                             uint32_t ntensors, qs_stream stream, const qs_pair *pairs, uint32_t npairs,
                             const qs_gain *gains);

/*
 * Scale recalibration of one trainable tensor with the FP16 buffer (SPEC "Scale
 * recalibration", qsched.zo.recalibrate). Element j of the tensor's count elements is in
 * channel j mod channels (channel_minor) or j div (count / channels). Each channel with
 * a weight at +-127 whose exponent exps[c] is below its limit halves its weights toward
 * zero, moves the half step an odd weight loses into its buffer value and adds one to
 * exps[c]. mult and shift are the blob's requantisation parameters of the channels.
 * Returns the number of channels that grew.
 */
#define QS_RECAL_EXP_MAX 8
#define QS_RECAL_SHIFT_MAX 30
uint32_t qs_recalibrate_fp16(int8_t *w, uint16_t *buf, uint32_t count, uint32_t channels, int channel_minor,
                             int8_t *exps, const int32_t *mult, const int32_t *shift);

/* The largest exponent of a channel: min(8, 30 - shift) floored at 0; 0 when mult is 0. */
int32_t qs_recal_exp_limit(int32_t mult, int32_t shift);

/* Continue the weight checksum over binary16 values, little-endian bytes. */
uint32_t qs_crc32_fp16(uint32_t crc, const uint16_t *buf, uint32_t count);

/* Continue the weight checksum over float32 values, little-endian bytes. */
uint32_t qs_crc32_f32(uint32_t crc, const float *theta, uint32_t count);

#endif
