#include "kernels.h"

#include "qs_status.h"
#include "quant.h"

#include <string.h>

static int32_t offset4(qs_shape s, int32_t n, int32_t h, int32_t w, int32_t c)
{
    return ((n * s.h + h) * s.w + w) * s.c + c;
}

static int8_t requant_out(int32_t acc, qs_requant rq, int32_t channel, int32_t output_offset,
                          int32_t act_min, int32_t act_max, int32_t single_rounding)
{
    /* The requantised value fits int64 in both variants; the output offset is in
     * [-128, 127]; the clamp brings the sum to [act_min, act_max] within int8. */
    const int64_t scaled = qs_requantize(acc, rq.multiplier[channel], rq.shift[channel], single_rounding);
    const int64_t shifted = scaled + output_offset;
    const int64_t lo = act_min, hi = act_max;
    return (int8_t)(shifted < lo ? lo : (shifted > hi ? hi : shifted));
}

void qs_conv_s8(const qs_conv_params *p, qs_requant rq, qs_shape in_shape, const int8_t *input,
                qs_shape filter_shape, const int8_t *filter, const int32_t *bias, qs_shape out_shape,
                int8_t *output)
{
    const int32_t filter_depth = filter_shape.c; /* input channels per group */
    const int32_t per_group = out_shape.c / p->groups;
    QS_ASSERT(filter_depth * p->groups == in_shape.c && filter_shape.n == out_shape.c);
    QS_ASSERT(filter_shape.h * filter_shape.w * filter_depth <= QS_MAX_ACC_DEPTH);
    for (int32_t b = 0; b < out_shape.n; ++b) {
        for (int32_t oy = 0; oy < out_shape.h; ++oy) {
            const int32_t y0 = oy * p->stride_h - p->pad_h;
            for (int32_t ox = 0; ox < out_shape.w; ++ox) {
                const int32_t x0 = ox * p->stride_w - p->pad_w;
                for (int32_t oc = 0; oc < out_shape.c; ++oc) {
                    const int32_t group = oc / per_group;
                    /* At most QS_MAX_ACC_DEPTH products of magnitude <= QS_MAX_PRODUCT:
                     * |acc| < 2^31 (see kernels.h). */
                    int32_t acc = 0;
                    for (int32_t fy = 0; fy < filter_shape.h; ++fy) {
                        const int32_t y = y0 + fy;
                        if (y < 0 || y >= in_shape.h) {
                            continue;
                        }
                        for (int32_t fx = 0; fx < filter_shape.w; ++fx) {
                            const int32_t x = x0 + fx;
                            if (x < 0 || x >= in_shape.w) {
                                continue;
                            }
                            const int8_t *in = input + offset4(in_shape, b, y, x, group * filter_depth);
                            const int8_t *f = filter + offset4(filter_shape, oc, fy, fx, 0);
                            for (int32_t ic = 0; ic < filter_depth; ++ic) {
                                acc += (int32_t)f[ic] * ((int32_t)in[ic] + p->input_offset);
                            }
                        }
                    }
                    /* Prepare bounds |bias| <= 2^31 - 1 - depth * QS_MAX_PRODUCT. */
                    acc += bias[oc];
                    output[offset4(out_shape, b, oy, ox, oc)] =
                        requant_out(acc, rq, oc, p->output_offset, p->act_min, p->act_max, p->single_rounding);
                }
            }
        }
    }
}

void qs_depthwise_s8(const qs_conv_params *p, qs_requant rq, qs_shape in_shape, const int8_t *input,
                     qs_shape filter_shape, const int8_t *filter, const int32_t *bias,
                     qs_shape out_shape, int8_t *output)
{
    const int32_t dm = p->depth_multiplier;
    QS_ASSERT(filter_shape.n == 1 && filter_shape.c == in_shape.c * dm && out_shape.c == filter_shape.c);
    for (int32_t b = 0; b < out_shape.n; ++b) {
        for (int32_t oy = 0; oy < out_shape.h; ++oy) {
            const int32_t y0 = oy * p->stride_h - p->pad_h;
            for (int32_t ox = 0; ox < out_shape.w; ++ox) {
                const int32_t x0 = ox * p->stride_w - p->pad_w;
                for (int32_t ic = 0; ic < in_shape.c; ++ic) {
                    for (int32_t m = 0; m < dm; ++m) {
                        const int32_t oc = ic * dm + m;
                        int32_t acc = 0; /* kh*kw <= QS_MAX_ACC_DEPTH products: < 2^31 */
                        for (int32_t fy = 0; fy < filter_shape.h; ++fy) {
                            const int32_t y = y0 + fy;
                            if (y < 0 || y >= in_shape.h) {
                                continue;
                            }
                            for (int32_t fx = 0; fx < filter_shape.w; ++fx) {
                                const int32_t x = x0 + fx;
                                if (x < 0 || x >= in_shape.w) {
                                    continue;
                                }
                                const int32_t v = input[offset4(in_shape, b, y, x, ic)];
                                const int32_t f = filter[offset4(filter_shape, 0, fy, fx, oc)];
                                acc += f * (v + p->input_offset);
                            }
                        }
                        acc += bias[oc];
                        output[offset4(out_shape, b, oy, ox, oc)] =
                            requant_out(acc, rq, oc, p->output_offset, p->act_min, p->act_max, p->single_rounding);
                    }
                }
            }
        }
    }
}

void qs_fc_s8(const qs_fc_params *p, qs_requant rq, int32_t batch, int32_t depth, int32_t units,
              const int8_t *input, const int8_t *filter, const int32_t *bias, int8_t *output)
{
    QS_ASSERT(depth <= QS_MAX_ACC_DEPTH);
    for (int32_t b = 0; b < batch; ++b) {
        const int8_t *in = input + b * depth;
        for (int32_t u = 0; u < units; ++u) {
            const int8_t *f = filter + u * depth;
            int32_t acc = 0; /* depth <= QS_MAX_ACC_DEPTH products: |acc| < 2^31 */
            for (int32_t d = 0; d < depth; ++d) {
                acc += (int32_t)f[d] * ((int32_t)in[d] + p->input_offset);
            }
            acc += bias[u];
            output[b * units + u] =
                requant_out(acc, rq, u, p->output_offset, p->act_min, p->act_max, p->single_rounding);
        }
    }
}

/* The valid part [start, end) of a pooling window along one axis. */
static void window(int32_t origin, int32_t filter, int32_t size, int32_t *start, int32_t *end)
{
    *start = origin < 0 ? -origin : 0;
    *end = size - origin < filter ? size - origin : filter;
}

void qs_avgpool_s8(const qs_pool_params *p, qs_shape in_shape, const int8_t *input, qs_shape out_shape,
                   int8_t *output)
{
    for (int32_t b = 0; b < out_shape.n; ++b) {
        for (int32_t oy = 0; oy < out_shape.h; ++oy) {
            const int32_t y0 = oy * p->stride_h - p->pad_h;
            int32_t fy0, fy1;
            window(y0, p->filter_h, in_shape.h, &fy0, &fy1);
            for (int32_t ox = 0; ox < out_shape.w; ++ox) {
                const int32_t x0 = ox * p->stride_w - p->pad_w;
                int32_t fx0, fx1;
                window(x0, p->filter_w, in_shape.w, &fx0, &fx1);
                for (int32_t c = 0; c < out_shape.c; ++c) {
                    /* Window area <= QS_MAX_ACC_DEPTH values of |v| <= 128: < 2^24. */
                    int32_t acc = 0;
                    int32_t count = 0;
                    for (int32_t fy = fy0; fy < fy1; ++fy) {
                        for (int32_t fx = fx0; fx < fx1; ++fx) {
                            acc += input[offset4(in_shape, b, y0 + fy, x0 + fx, c)];
                            ++count;
                        }
                    }
                    QS_ASSERT(count > 0); /* Prepare rejects windows outside the input */
                    acc = acc > 0 ? (acc + count / 2) / count : (acc - count / 2) / count;
                    output[offset4(out_shape, b, oy, ox, c)] = (int8_t)qs_clamp(acc, p->act_min, p->act_max);
                }
            }
        }
    }
}

void qs_maxpool_s8(const qs_pool_params *p, qs_shape in_shape, const int8_t *input, qs_shape out_shape,
                   int8_t *output)
{
    for (int32_t b = 0; b < out_shape.n; ++b) {
        for (int32_t oy = 0; oy < out_shape.h; ++oy) {
            const int32_t y0 = oy * p->stride_h - p->pad_h;
            int32_t fy0, fy1;
            window(y0, p->filter_h, in_shape.h, &fy0, &fy1);
            for (int32_t ox = 0; ox < out_shape.w; ++ox) {
                const int32_t x0 = ox * p->stride_w - p->pad_w;
                int32_t fx0, fx1;
                window(x0, p->filter_w, in_shape.w, &fx0, &fx1);
                for (int32_t c = 0; c < out_shape.c; ++c) {
                    int32_t best = -128;
                    for (int32_t fy = fy0; fy < fy1; ++fy) {
                        for (int32_t fx = fx0; fx < fx1; ++fx) {
                            const int32_t v = input[offset4(in_shape, b, y0 + fy, x0 + fx, c)];
                            best = v > best ? v : best;
                        }
                    }
                    output[offset4(out_shape, b, oy, ox, c)] = (int8_t)qs_clamp(best, p->act_min, p->act_max);
                }
            }
        }
    }
}

void qs_add_s8(const qs_add_params *p, int32_t size, const int8_t *in1, const int8_t *in2, int8_t *output)
{
    const int sr = p->single_rounding;
    for (int32_t i = 0; i < size; ++i) {
        /* |x + offset| <= 255 < 2^8, shifted by left_shift <= 20 (Prepare): < 2^28.
         * Each input multiplier is below 1 (its scale over twice the larger one), so
         * the scaled values stay below 2^28 and their sum below 2^29: fits int32. */
        const int32_t a = ((int32_t)in1[i] + p->input1_offset) * (1 << p->left_shift);
        const int32_t b = ((int32_t)in2[i] + p->input2_offset) * (1 << p->left_shift);
        const int64_t sa = qs_requantize(a, p->input1_multiplier, p->input1_shift, sr);
        const int64_t sb = qs_requantize(b, p->input2_multiplier, p->input2_shift, sr);
        const int64_t raw = qs_requantize((int32_t)(sa + sb), p->output_multiplier, p->output_shift, sr) +
                            p->output_offset;
        output[i] = (int8_t)(raw < p->act_min ? p->act_min : (raw > p->act_max ? p->act_max : raw));
    }
}

void qs_requant_s8(const qs_requant_params *p, int32_t size, const int8_t *input, int8_t *output)
{
    for (int32_t i = 0; i < size; ++i) {
        /* |x + offset| <= 255; the requantised value and the offset sum in int64. */
        const int64_t o =
            qs_requantize((int32_t)input[i] + p->input_offset, p->multiplier, p->shift, p->single_rounding) +
            p->output_offset;
        output[i] = (int8_t)(o < p->act_min ? p->act_min : (o > p->act_max ? p->act_max : o));
    }
}

void qs_mean_s8(const qs_mean_params *p, qs_shape in_shape, const int8_t *input, int8_t *output)
{
    const int32_t count = in_shape.h * in_shape.w;
    for (int32_t c = 0; c < in_shape.c; ++c) {
        int32_t sum = 0;
        for (int32_t i = 0; i < count; ++i) {
            sum += input[i * in_shape.c + c];
        }
        const int32_t centred = sum - p->input_zero_point * count;
        const int32_t y = qs_mbqm(centred, p->multiplier, p->shift) + p->output_zero_point;
        output[c] = (int8_t)qs_clamp(y, -128, 127);
    }
}

void qs_pad_s8(const qs_pad_params *p, qs_shape in_shape, const int8_t *input, int8_t *output)
{
    const int32_t out_w = in_shape.w + p->left + p->right;
    const int32_t out_h = in_shape.h + p->top + p->bottom;
    const size_t row = (size_t)in_shape.w * (size_t)in_shape.c;
    memset(output, p->value, (size_t)out_h * (size_t)out_w * (size_t)in_shape.c);
    for (int32_t y = 0; y < in_shape.h; ++y) {
        int8_t *dst = output + ((size_t)(y + p->top) * (size_t)out_w + (size_t)p->left) * (size_t)in_shape.c;
        memcpy(dst, input + (size_t)y * row, row);
    }
}

void qs_concat_s8(uint32_t rows, uint32_t a_channels, const int8_t *a, uint32_t b_channels, const int8_t *b,
                  int8_t *output)
{
    for (uint32_t r = 0; r < rows; ++r) {
        memcpy(output, a + (size_t)r * a_channels, a_channels);
        memcpy(output + a_channels, b + (size_t)r * b_channels, b_channels);
        output += a_channels + b_channels;
    }
}

void qs_mul_s8(const qs_mul_params *p, const int8_t *a, const int8_t *b, int8_t *output)
{
    for (uint32_t r = 0; r < p->rows; ++r) {
        const int8_t *row_b = p->b_is_gate ? b : b + (size_t)r * p->channels;
        for (uint32_t c = 0; c < p->channels; ++c) {
            const size_t i = (size_t)r * p->channels + c;
            const int32_t product = (a[i] + p->a_offset) * (row_b[c] + p->b_offset);
            const int32_t y = qs_mbqm(product, p->multiplier, p->shift) + p->output_offset;
            output[i] = (int8_t)qs_clamp(y, p->act_min, p->act_max);
        }
    }
}

void qs_lut_s8(const int8_t *table, uint32_t size, const int8_t *input, int8_t *output)
{
    for (uint32_t i = 0; i < size; ++i) {
        output[i] = table[input[i] + 128];
    }
}
