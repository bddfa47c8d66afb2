/*
 * INT8 reference kernels: pure math per operation, in the style of TFLite Micro's
 * reference/integer_ops. No validation here beyond QS_ASSERT: the runtime (model.c)
 * checks every shape and parameter once in Prepare, so Eval is integer-only, never
 * allocates and never fails.
 *
 * Tensors are NHWC int8 with asymmetric quantisation; weights are per-channel
 * symmetric int8 (zero point 0); biases are int32 with scale s_in * s_w.
 */
#ifndef QS_KERNELS_H
#define QS_KERNELS_H

#include <stdint.h>

typedef struct {
    int32_t n, h, w, c;
} qs_shape;

/* Accumulation depth bound: an int8 weight (|w| <= 128, even if a blob holds -128) times
 * x - zp with both int8 (|x - zp| <= 255) is at most 32640 < 2^15 in magnitude, so at
 * most 2^16 products sum to below 2^31 (65536 * 32640 = 2139095040 < 2147483647).
 * Prepare checks every zero point against its tensor (int8 range) and bounds |bias| so
 * that sum + bias fits as well. */
#define QS_MAX_ACC_DEPTH 65536
#define QS_MAX_PRODUCT 32640

typedef struct {
    int32_t input_offset;  /* minus the input zero point */
    int32_t output_offset; /* the output zero point */
    int32_t stride_h, stride_w;
    int32_t pad_h, pad_w; /* top/left padding, TFLite's ComputePaddingHeightWidth */
    int32_t act_min, act_max;
    int32_t groups;           /* Conv2D: input channels split into groups */
    int32_t depth_multiplier; /* depthwise: output channels per input channel */
    int32_t single_rounding;  /* requantise with TFLITE_SINGLE_ROUNDING arithmetic */
} qs_conv_params;

/* Per-output-channel requantisation, from Prepare. */
typedef struct {
    const int32_t *multiplier;
    const int32_t *shift;
} qs_requant;

/* Conv2D, filter (O, kh, kw, C/groups) (OHWI), bias (O), output (N, oh, ow, O). */
void qs_conv_s8(const qs_conv_params *p, qs_requant rq, qs_shape in_shape, const int8_t *input,
                qs_shape filter_shape, const int8_t *filter, const int32_t *bias, qs_shape out_shape,
                int8_t *output);

/* Depthwise Conv2D, filter (1, kh, kw, C*dm) (1HWO). */
void qs_depthwise_s8(const qs_conv_params *p, qs_requant rq, qs_shape in_shape, const int8_t *input,
                     qs_shape filter_shape, const int8_t *filter, const int32_t *bias,
                     qs_shape out_shape, int8_t *output);

typedef struct {
    int32_t input_offset;
    int32_t output_offset;
    int32_t act_min, act_max;
    int32_t single_rounding;
} qs_fc_params;

/* Fully connected: input (batch, depth), filter (units, depth), output (batch, units). */
void qs_fc_s8(const qs_fc_params *p, qs_requant rq, int32_t batch, int32_t depth, int32_t units,
              const int8_t *input, const int8_t *filter, const int32_t *bias, int8_t *output);

typedef struct {
    int32_t stride_h, stride_w;
    int32_t filter_h, filter_w;
    int32_t pad_h, pad_w;
    int32_t act_min, act_max;
} qs_pool_params;

/* Average pooling over the valid part of each window (TFLite AveragePool int8). */
void qs_avgpool_s8(const qs_pool_params *p, qs_shape in_shape, const int8_t *input, qs_shape out_shape,
                   int8_t *output);

/* Max pooling (TFLite MaxPool int8). */
void qs_maxpool_s8(const qs_pool_params *p, qs_shape in_shape, const int8_t *input, qs_shape out_shape,
                   int8_t *output);

typedef struct {
    int32_t left_shift; /* 20 in TFLite */
    int32_t input1_offset, input2_offset, output_offset;
    int32_t input1_multiplier, input1_shift;
    int32_t input2_multiplier, input2_shift;
    int32_t output_multiplier, output_shift;
    int32_t act_min, act_max;
    int32_t single_rounding;
} qs_add_params;

/* Element-wise add of two int8 tensors of one shape (TFLite Add int8). */
void qs_add_s8(const qs_add_params *p, int32_t size, const int8_t *in1, const int8_t *in2, int8_t *output);

typedef struct {
    int32_t input_offset; /* minus the input zero point */
    int32_t output_offset;
    int32_t multiplier, shift;
    int32_t act_min, act_max;
    int32_t single_rounding;
} qs_requant_params;

/* Requantise element-wise with a clamp: TFLite's int8 ReLU/ReLU6 and rescaling. */
void qs_requant_s8(const qs_requant_params *p, int32_t size, const int8_t *input, int8_t *output);

typedef struct {
    int32_t input_zero_point, output_zero_point;
    int32_t multiplier, shift; /* in_scale / out_scale with 1/count folded in (Prepare) */
} qs_mean_params;

/* MEAN over height and width, (H, W, C) -> (C): TFLite's reference QuantizedMeanOrSum.
 * Sums stay below 2^31: count <= QS_MAX_ACC_DEPTH and |x|, |zp| <= 128. */
void qs_mean_s8(const qs_mean_params *p, qs_shape in_shape, const int8_t *input, int8_t *output);

typedef struct {
    int32_t top, bottom, left, right;
    int32_t value; /* the output zero point */
} qs_pad_params;

/* Constant padding of height and width (TFLite PAD int8): input bytes copied as they are. */
void qs_pad_s8(const qs_pad_params *p, qs_shape in_shape, const int8_t *input, int8_t *output);

typedef struct {
    int32_t a_offset, b_offset, output_offset; /* minus the inputs' zero points; the output's */
    int32_t multiplier, shift;
    int32_t act_min, act_max;
    uint32_t rows, channels; /* a is rows x channels */
    int32_t b_is_gate;       /* b is one row of channels, shared by every row of a */
} qs_mul_params;

/* MUL of two int8 tensors (TFLite's reference MulElementwise, double rounding). A product
 * of centred int8 values is at most 2^16 in magnitude, so int32 holds it. */
void qs_mul_s8(const qs_mul_params *p, const int8_t *a, const int8_t *b, int8_t *output);

/* An int8 function of one int8 input as its 256 values (LOGISTIC, HARD_SWISH, MUL by a
 * constant): the
 * model blob carries the table, computed as TFLite's reference kernels compute. */
void qs_lut_s8(const int8_t *table, uint32_t size, const int8_t *input, int8_t *output);

/* CONCATENATION on the last axis of rows elements: each row is a's channels then b's. */
void qs_concat_s8(uint32_t rows, uint32_t a_channels, const int8_t *a, uint32_t b_channels, const int8_t *b,
                  int8_t *output);

#endif
