#include "model.h"

#include <string.h>

#include "crc32.h"

#define NUMERICS_INT8 1u
#define FLAG_SINGLE_ROUNDING 1u
#define DTYPE_INT8 1u
#define NO_TENSOR 0xFFFFu
#define PADDING_SAME 0u
#define PADDING_VALID 1u
#define MAX_TENSOR_ELEMENTS (1u << 24)

static uint32_t le16(const uint8_t *p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8); }
static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static int32_t sle16(const uint8_t *p) { return (int32_t)(int16_t)(uint16_t)le16(p); }
static int32_t sle32(const uint8_t *p) { return (int32_t)le32(p); }

/* The raw fields of one op record (SPEC "Model blob"). */
typedef struct {
    uint32_t opcode, activation, padding, flags, in0, in1, out;
    uint32_t window_h, window_w, stride_h, stride_w, groups;
    int32_t act_min, act_max, in_zp, out_zp;
    uint32_t w_dims[4];
    uint32_t weight_off, bias_off, mult_off, shift_off, scales_off, weight_count, channels, param_offset;
    int32_t aux[7];
    int32_t in1_zp;
} op_record;

static void read_op(const uint8_t *r, op_record *o)
{
    o->opcode = r[32];
    o->activation = r[33];
    o->padding = r[34];
    o->flags = r[35];
    o->in0 = le16(r + 36);
    o->in1 = le16(r + 38);
    o->out = le16(r + 40);
    o->window_h = le16(r + 44);
    o->window_w = le16(r + 46);
    o->stride_h = le16(r + 48);
    o->stride_w = le16(r + 50);
    o->groups = le16(r + 52);
    o->act_min = sle16(r + 56);
    o->act_max = sle16(r + 58);
    o->in_zp = sle32(r + 60);
    o->out_zp = sle32(r + 64);
    for (unsigned i = 0; i < 4u; ++i) {
        o->w_dims[i] = le16(r + 68 + 2 * i);
    }
    o->weight_off = le32(r + 76);
    o->bias_off = le32(r + 80);
    o->mult_off = le32(r + 84);
    o->shift_off = le32(r + 88);
    o->scales_off = le32(r + 92);
    o->weight_count = le32(r + 96);
    o->channels = le32(r + 100);
    o->param_offset = le32(r + 104);
    for (unsigned i = 0; i < 7u; ++i) {
        o->aux[i] = sle32(r + 108 + 4 * i);
    }
    o->in1_zp = sle32(r + 136);
}

/* The data section and what Prepare checks against it. */
typedef struct {
    uint8_t *base;
    uint32_t size;
} data_section;

/* A 4-aligned array of count elements of width bytes inside the data section, or NULL. */
static void *data_array(const data_section *d, uint32_t offset, uint32_t count, uint32_t width)
{
    if (offset % 4u != 0u || offset > d->size || count > (d->size - offset) / width) {
        return NULL;
    }
    return d->base + offset;
}

static uint32_t out_size(uint32_t size, uint32_t kernel, uint32_t stride, uint32_t padding)
{
    if (padding == PADDING_SAME) {
        return (size + stride - 1u) / stride;
    }
    return size >= kernel ? (size - kernel) / stride + 1u : 0u;
}

/* TFLite's padding before the data along one axis (the odd element goes after). */
static int32_t pad_before(uint32_t size, uint32_t kernel, uint32_t stride, uint32_t out)
{
    const int64_t total = (int64_t)(out - 1u) * stride + kernel - size;
    return total > 0 ? (int32_t)(total / 2) : 0;
}

static qs_shape shape3(const qs_tensor *t)
{
    qs_shape s = {1, (int32_t)t->dims[0], (int32_t)t->dims[1], (int32_t)t->dims[2]};
    return s;
}

static int same_quant(const qs_tensor *a, const qs_tensor *b)
{
    return a->scale_bits == b->scale_bits && a->zero_point == b->zero_point;
}

/* Requantisation arrays: multipliers in [0, 2^31), shifts in [-31, 30]. */
static qs_status prepare_requant(qs_op *op, const op_record *o, const data_section *d)
{
    op->rq.multiplier = (const int32_t *)data_array(d, o->mult_off, o->channels, 4);
    op->rq.shift = (const int32_t *)data_array(d, o->shift_off, o->channels, 4);
    op->bias = (const int32_t *)data_array(d, o->bias_off, o->channels, 4);
    op->weight = (const int8_t *)data_array(d, o->weight_off, o->weight_count, 1);
    op->scales = (const float *)data_array(d, o->scales_off, o->channels, 4);
    op->channels = o->channels;
    op->blob_shift = op->rq.shift;
    op->blob_bias = op->bias;
    op->blob_scales = op->scales;
    if (op->rq.multiplier == NULL || op->rq.shift == NULL || op->bias == NULL || op->weight == NULL ||
        op->scales == NULL) {
        return QS_ERR_FORMAT;
    }
    for (uint32_t c = 0; c < o->channels; ++c) {
        if (op->rq.multiplier[c] < 0 || op->rq.shift[c] < -31 || op->rq.shift[c] > 30) {
            return QS_ERR_ARG;
        }
    }
    return QS_OK;
}

/* The accumulator bound of kernels.h: depth products plus the bias must fit int32. */
static qs_status check_bias(const qs_op *op, uint32_t channels, uint32_t depth)
{
    if (depth == 0u || depth > QS_MAX_ACC_DEPTH) {
        return QS_ERR_ARG;
    }
    const int64_t room = (int64_t)INT32_MAX - (int64_t)depth * QS_MAX_PRODUCT;
    for (uint32_t c = 0; c < channels; ++c) {
        if (op->bias[c] > room || op->bias[c] < -room) {
            return QS_ERR_ARG;
        }
    }
    return QS_OK;
}

static int act_ok(const op_record *o)
{
    return o->act_min >= -128 && o->act_max <= 127 && o->act_min <= o->act_max;
}

static qs_status prepare_conv(qs_model *m, qs_op *op, const op_record *o, const data_section *d)
{
    const qs_tensor *in = &m->tensors[o->in0], *out = &m->tensors[o->out];
    const int depthwise = o->opcode == QS_OP_DEPTHWISE;
    if (in->rank != 3u || out->rank != 3u || o->stride_h == 0u || o->stride_w == 0u || o->padding > 1u ||
        !act_ok(o) || o->channels != out->dims[2]) {
        return QS_ERR_ARG;
    }
    const uint32_t kh = o->w_dims[1], kw = o->w_dims[2];
    /* Products in 64 bits: four u16 dims could wrap a u32 and fake a small count. */
    if (kh == 0u || kw == 0u || kh != o->window_h || kw != o->window_w ||
        (uint64_t)o->weight_count != (uint64_t)o->w_dims[0] * kh * kw * o->w_dims[3]) {
        return QS_ERR_ARG;
    }
    uint32_t depth;
    if (depthwise) {
        if (o->w_dims[0] != 1u || o->w_dims[3] != out->dims[2] || out->dims[2] % in->dims[2] != 0u) {
            return QS_ERR_ARG;
        }
        op->conv.depth_multiplier = (int32_t)(out->dims[2] / in->dims[2]);
        op->conv.groups = 1;
        depth = kh * kw;
    } else {
        if (o->groups == 0u || o->w_dims[0] != out->dims[2] || o->w_dims[3] * o->groups != in->dims[2] ||
            out->dims[2] % o->groups != 0u) {
            return QS_ERR_ARG;
        }
        op->conv.groups = (int32_t)o->groups;
        op->conv.depth_multiplier = 1;
        depth = kh * kw * o->w_dims[3]; /* <= weight_count, which fits u32 */
    }
    if (out->dims[0] != out_size(in->dims[0], kh, o->stride_h, o->padding) ||
        out->dims[1] != out_size(in->dims[1], kw, o->stride_w, o->padding)) {
        return QS_ERR_ARG;
    }
    qs_status st = prepare_requant(op, o, d);
    if (st == QS_OK) {
        st = check_bias(op, o->channels, depth);
    }
    op->conv.input_offset = -o->in_zp;
    op->conv.output_offset = o->out_zp;
    op->conv.stride_h = (int32_t)o->stride_h;
    op->conv.stride_w = (int32_t)o->stride_w;
    op->conv.pad_h = pad_before(in->dims[0], kh, o->stride_h, out->dims[0]);
    op->conv.pad_w = pad_before(in->dims[1], kw, o->stride_w, out->dims[1]);
    op->conv.act_min = o->act_min;
    op->conv.act_max = o->act_max;
    op->conv.single_rounding = 0; /* CONV_2D and DEPTHWISE keep the reference double rounding */
    op->in_shape = shape3(in);
    op->out_shape = shape3(out);
    const qs_shape f = {(int32_t)o->w_dims[0], (int32_t)kh, (int32_t)kw, (int32_t)o->w_dims[3]};
    op->filter_shape = f;
    return st;
}

static qs_status prepare_dense(qs_model *m, qs_op *op, const op_record *o, const data_section *d)
{
    const qs_tensor *in = &m->tensors[o->in0], *out = &m->tensors[o->out];
    const uint32_t units = o->w_dims[0], depth = o->w_dims[1];
    if (o->w_dims[2] != 0u || units != o->channels || units != out->size || depth != in->size ||
        (uint64_t)o->weight_count != (uint64_t)units * depth || !act_ok(o)) {
        return QS_ERR_ARG;
    }
    qs_status st = prepare_requant(op, o, d);
    if (st == QS_OK) {
        st = check_bias(op, units, depth);
    }
    op->fc.input_offset = -o->in_zp;
    op->fc.output_offset = o->out_zp;
    op->fc.act_min = o->act_min;
    op->fc.act_max = o->act_max;
    /* FULLY_CONNECTED requantises with single rounding when the blob says so. */
    op->fc.single_rounding = (int32_t)m->single_rounding;
    return st;
}

static qs_status prepare_pool(qs_model *m, qs_op *op, const op_record *o)
{
    const qs_tensor *in = &m->tensors[o->in0], *out = &m->tensors[o->out];
    if (!same_quant(in, out) || !act_ok(o) || in->rank != 3u) {
        return QS_ERR_ARG;
    }
    op->in_shape = shape3(in);
    if (o->opcode == QS_OP_GLOBALAVG) {
        if (out->rank != 1u || out->dims[0] != in->dims[2] || in->dims[0] * in->dims[1] > QS_MAX_ACC_DEPTH) {
            return QS_ERR_ARG;
        }
        const qs_pool_params p = {1, 1, (int32_t)in->dims[0], (int32_t)in->dims[1], 0, 0, -128, 127};
        const qs_shape s = {1, 1, 1, (int32_t)in->dims[2]};
        op->pool = p;
        op->out_shape = s;
        return QS_OK;
    }
    if (out->rank != 3u || out->dims[2] != in->dims[2] || o->stride_h == 0u || o->stride_w == 0u ||
        o->window_h == 0u || o->window_w == 0u || o->padding > 1u ||
        o->window_h * o->window_w > QS_MAX_ACC_DEPTH ||
        out->dims[0] != out_size(in->dims[0], o->window_h, o->stride_h, o->padding) ||
        out->dims[1] != out_size(in->dims[1], o->window_w, o->stride_w, o->padding)) {
        return QS_ERR_ARG;
    }
    op->out_shape = shape3(out);
    op->pool.stride_h = (int32_t)o->stride_h;
    op->pool.stride_w = (int32_t)o->stride_w;
    op->pool.filter_h = (int32_t)o->window_h;
    op->pool.filter_w = (int32_t)o->window_w;
    /* pad < window, so every window holds at least one input element. */
    op->pool.pad_h = pad_before(in->dims[0], o->window_h, o->stride_h, out->dims[0]);
    op->pool.pad_w = pad_before(in->dims[1], o->window_w, o->stride_w, out->dims[1]);
    op->pool.act_min = o->act_min;
    op->pool.act_max = o->act_max;
    return QS_OK;
}

/* MEAN over height and width: aux = multiplier (1/count folded in), shift, keep_dims. */
static qs_status prepare_mean(qs_model *m, qs_op *op, const op_record *o)
{
    const qs_tensor *in = &m->tensors[o->in0], *out = &m->tensors[o->out];
    const uint32_t keep = (uint32_t)o->aux[2];
    const int out_ok = keep ? (out->rank == 3u && out->dims[0] == 1u && out->dims[1] == 1u)
                            : (out->rank == 1u);
    if (in->rank != 3u || !out_ok || out->size != in->dims[2] || keep > 1u ||
        in->dims[0] * in->dims[1] > QS_MAX_ACC_DEPTH || o->aux[0] < 0 || o->aux[1] < -31 || o->aux[1] > 30) {
        return QS_ERR_ARG;
    }
    op->in_shape = shape3(in);
    const qs_mean_params p = {o->in_zp, o->out_zp, o->aux[0], o->aux[1]};
    op->mean = p;
    return QS_OK;
}

/* PAD of height and width with the zero point: aux = top, bottom, left, right. */
static qs_status prepare_pad(qs_model *m, qs_op *op, const op_record *o)
{
    const qs_tensor *in = &m->tensors[o->in0], *out = &m->tensors[o->out];
    for (unsigned i = 0; i < 4u; ++i) {
        if (o->aux[i] < 0 || o->aux[i] > 0xFFFF) {
            return QS_ERR_ARG;
        }
    }
    if (in->rank != 3u || out->rank != 3u || !same_quant(in, out) || out->dims[2] != in->dims[2] ||
        out->dims[0] != in->dims[0] + (uint32_t)o->aux[0] + (uint32_t)o->aux[1] ||
        out->dims[1] != in->dims[1] + (uint32_t)o->aux[2] + (uint32_t)o->aux[3]) {
        return QS_ERR_ARG;
    }
    op->in_shape = shape3(in);
    const qs_pad_params p = {o->aux[0], o->aux[1], o->aux[2], o->aux[3], o->out_zp};
    op->pad = p;
    return QS_OK;
}

/* CONCATENATION on the channel axis: both inputs and the output quantised alike (the
 * int8 kernel copies bytes), the same leading dims, the output's channels their sum. */
static qs_status prepare_concat(qs_model *m, qs_op *op, const op_record *o)
{
    const qs_tensor *a = &m->tensors[o->in0], *b = &m->tensors[o->in1], *out = &m->tensors[o->out];
    if (a->rank != b->rank || a->rank != out->rank || a->rank == 0u || !same_quant(a, out) ||
        !same_quant(b, out) || !act_ok(o)) {
        return QS_ERR_ARG;
    }
    const uint32_t last = a->rank - 1u;
    for (uint32_t i = 0; i < last; ++i) {
        if (a->dims[i] != b->dims[i] || a->dims[i] != out->dims[i]) {
            return QS_ERR_ARG;
        }
    }
    if (out->dims[last] != a->dims[last] + b->dims[last]) {
        return QS_ERR_ARG;
    }
    op->concat_a = a->dims[last];
    op->concat_b = b->dims[last];
    return QS_OK;
}

/* MUL: b of a's shape, or a (1, 1, C) gate of an (H, W, C) a; aux = multiplier, shift. */
static qs_status prepare_mul(qs_model *m, qs_op *op, const op_record *o)
{
    const qs_tensor *a = &m->tensors[o->in0], *b = &m->tensors[o->in1], *out = &m->tensors[o->out];
    const int gate = a->rank == 3u && b->rank == 3u && b->dims[0] == 1u && b->dims[1] == 1u &&
                     b->dims[2] == a->dims[2] && a->size != b->size;
    if (out->size != a->size || (b->size != a->size && !gate) || a->rank == 0u || !act_ok(o) ||
        o->aux[0] < 0 || o->aux[1] < -31 || o->aux[1] > 30) {
        return QS_ERR_ARG;
    }
    const uint32_t channels = a->dims[a->rank - 1u];
    const qs_mul_params p = {-o->in_zp, -o->in1_zp, o->out_zp, o->aux[0], o->aux[1], o->act_min,
                             o->act_max, a->size / channels, channels, gate};
    op->mul = p;
    return QS_OK;
}

/* LOGISTIC, HARD_SWISH, MUL by a constant: a 256-byte table at the weight offset. */
static qs_status prepare_table(qs_model *m, qs_op *op, const op_record *o, const data_section *d)
{
    const qs_tensor *in = &m->tensors[o->in0], *out = &m->tensors[o->out];
    if (in->size != out->size || o->weight_count != 256u || !act_ok(o)) {
        return QS_ERR_ARG;
    }
    op->table = (const int8_t *)data_array(d, o->weight_off, 256u, 1);
    return op->table != NULL ? QS_OK : QS_ERR_FORMAT;
}

static qs_status prepare_elementwise(qs_model *m, qs_op *op, const op_record *o)
{
    const qs_tensor *in = &m->tensors[o->in0], *out = &m->tensors[o->out];
    if (in->size != out->size || !act_ok(o)) {
        return QS_ERR_ARG;
    }
    if (o->opcode == QS_OP_RESHAPE) {
        return same_quant(in, out) ? QS_OK : QS_ERR_ARG;
    }
    if (o->opcode == QS_OP_RELU || o->opcode == QS_OP_RELU6) {
        if (o->aux[0] < 0 || o->aux[1] < -31 || o->aux[1] > 30) {
            return QS_ERR_ARG;
        }
        const qs_requant_params r = {-o->in_zp, o->out_zp, o->aux[0], o->aux[1], o->act_min, o->act_max, 0};
        op->relu = r;
        return QS_OK;
    }
    /* ADD: TFLite's left shift is 20; |x - zp| << 20 < 2^28 keeps int32 sums safe. */
    if (o->in1 >= m->n_tensors || m->tensors[o->in1].size != out->size || o->aux[0] < 0 || o->aux[0] > 20) {
        return QS_ERR_ARG;
    }
    for (unsigned i = 1; i < 7u; i += 2u) {
        if (o->aux[i] < 0 || o->aux[i + 1] < -31 || o->aux[i + 1] > 30) {
            return QS_ERR_ARG;
        }
    }
    /* Input multipliers are below one (scale over twice the larger scale): shift < 0. */
    if (o->aux[2] > 0 || o->aux[4] > 0) {
        return QS_ERR_ARG;
    }
    const qs_add_params a = {o->aux[0], -o->in_zp, -o->in1_zp, o->out_zp, o->aux[1], o->aux[2], o->aux[3],
                             o->aux[4], o->aux[5], o->aux[6], o->act_min, o->act_max, 0};
    op->add = a;
    return QS_OK;
}

static qs_status prepare_op(qs_model *m, qs_op *op, const op_record *o, const data_section *d)
{
    switch (o->opcode) {
    case QS_OP_CONV:
    case QS_OP_DEPTHWISE: return prepare_conv(m, op, o, d);
    case QS_OP_DENSE: return prepare_dense(m, op, o, d);
    case QS_OP_AVGPOOL:
    case QS_OP_MAXPOOL:
    case QS_OP_GLOBALAVG: return prepare_pool(m, op, o);
    case QS_OP_RELU:
    case QS_OP_RELU6:
    case QS_OP_ADD:
    case QS_OP_RESHAPE: return prepare_elementwise(m, op, o);
    case QS_OP_MEAN: return prepare_mean(m, op, o);
    case QS_OP_PAD: return prepare_pad(m, op, o);
    case QS_OP_CONCAT: return prepare_concat(m, op, o);
    case QS_OP_MUL: return prepare_mul(m, op, o);
    case QS_OP_LOGISTIC:
    case QS_OP_HARD_SWISH:
    case QS_OP_MUL_CONSTANT: return prepare_table(m, op, o, d);
    default: return QS_ERR_UNSUPPORTED;
    }
}

static qs_status read_tensors(qs_model *m, const uint8_t *rec)
{
    for (uint32_t i = 0; i < m->n_tensors; ++i, rec += QS_BLOB_TENSOR_SIZE) {
        qs_tensor *t = &m->tensors[i];
        t->rank = rec[32];
        if (t->rank == 0u || t->rank > QS_MODEL_MAX_RANK || rec[33] != DTYPE_INT8) {
            return t->rank == 0u || t->rank > QS_MODEL_MAX_RANK ? QS_ERR_ARG : QS_ERR_UNSUPPORTED;
        }
        t->size = 1;
        for (uint32_t j = 0; j < QS_MODEL_MAX_RANK; ++j) {
            t->dims[j] = le16(rec + 36 + 2 * j);
            if (j < t->rank) {
                if (t->dims[j] == 0u || t->size > MAX_TENSOR_ELEMENTS / t->dims[j]) {
                    return QS_ERR_ARG;
                }
                t->size *= t->dims[j];
            }
        }
        t->scale_bits = le32(rec + 44);
        t->zero_point = sle32(rec + 48);
        if (t->zero_point < -128 || t->zero_point > 127) {
            return QS_ERR_ARG;
        }
    }
    return QS_OK;
}

/* Ops in order, each reading only tensors already defined; trainable weights tile
 * [0, num_params) in model order. */
static qs_status read_ops(qs_model *m, const uint8_t *rec, const data_section *d)
{
    static uint8_t defined[QS_MODEL_MAX_TENSORS];
    memset(defined, 0, sizeof defined);
    defined[m->input] = 1;
    uint32_t flat = 0;
    for (uint32_t i = 0; i < m->n_ops; ++i, rec += QS_BLOB_OP_SIZE) {
        op_record o;
        read_op(rec, &o);
        qs_op *op = &m->ops[i];
        memset(op, 0, sizeof *op);
        const int binary = o.opcode == QS_OP_ADD || o.opcode == QS_OP_CONCAT || o.opcode == QS_OP_MUL;
        if (o.in0 >= m->n_tensors || o.out >= m->n_tensors || !defined[o.in0] || defined[o.out] ||
            (binary ? (o.in1 >= m->n_tensors || !defined[o.in1]) : o.in1 != NO_TENSOR)) {
            return QS_ERR_ARG;
        }
        /* The op's zero points must be its tensors' (int8 range, checked there): the
         * accumulator bounds of kernels.h rely on |x - zp| <= 255. */
        if (o.in_zp != m->tensors[o.in0].zero_point || o.out_zp != m->tensors[o.out].zero_point ||
            (binary && o.in1_zp != m->tensors[o.in1].zero_point)) {
            return QS_ERR_ARG;
        }
        op->opcode = o.opcode;
        op->in0 = o.in0;
        op->in1 = binary ? o.in1 : 0u;
        op->out = o.out;
        qs_status st = prepare_op(m, op, &o, d);
        if (st != QS_OK) {
            return st;
        }
        defined[o.out] = 1;
        op->trainable = o.flags & 1u;
        if (op->trainable) {
            if (op->weight == NULL || o.param_offset != flat) {
                return QS_ERR_ARG;
            }
            op->param_offset = flat;
            op->weight_count = o.weight_count;
            flat += o.weight_count;
        }
    }
    return flat == m->num_params && defined[m->output] ? QS_OK : QS_ERR_ARG;
}

static qs_status read_header(qs_model *m, const uint8_t *b, size_t len, uint32_t *data_size)
{
    if (len < QS_BLOB_HEADER_SIZE + QS_BLOB_TABLE_SIZE || memcmp(b, "QZMB", 4) != 0 || le16(b + 4) != 1u) {
        return QS_ERR_FORMAT;
    }
    if (b[6] != NUMERICS_INT8) {
        return QS_ERR_UNSUPPORTED; /* FP32 blobs: a host-side research mode */
    }
    m->single_rounding = b[7] & FLAG_SINGLE_ROUNDING;
    m->n_tensors = le16(b + 8);
    m->n_ops = le16(b + 10);
    m->input = le16(b + 12);
    m->output = le16(b + 14);
    m->num_classes = le32(b + 16);
    m->num_params = le32(b + 20);
    *data_size = le32(b + 24);
    const uint32_t crc = le32(b + 28);
    m->loss.scale_q24 = le32(b + 36);
    if (m->n_tensors == 0u || m->n_tensors > QS_MODEL_MAX_TENSORS || m->n_ops > QS_MODEL_MAX_OPS ||
        m->input >= m->n_tensors || m->output >= m->n_tensors || m->num_classes == 0u ||
        m->num_classes > QS_MODEL_MAX_CLASSES) {
        return QS_ERR_ARG;
    }
    const uint64_t expected = (uint64_t)QS_BLOB_HEADER_SIZE + QS_BLOB_TABLE_SIZE +
                              (uint64_t)m->n_tensors * QS_BLOB_TENSOR_SIZE +
                              (uint64_t)m->n_ops * QS_BLOB_OP_SIZE + *data_size;
    if (expected != len) {
        return QS_ERR_FORMAT;
    }
    if (qs_crc32_update(0, b + QS_BLOB_HEADER_SIZE, len - QS_BLOB_HEADER_SIZE) != crc) {
        return QS_ERR_CRC;
    }
    for (uint32_t d = 0; d < QS_LOSS_TABLE_SIZE; ++d) {
        m->loss.exp_table[d] = le32(b + QS_BLOB_HEADER_SIZE + 4u * d);
    }
    return qs_loss_check(&m->loss);
}

qs_status qs_model_prepare(qs_model *m, uint8_t *blob, size_t len, int8_t *scratch, size_t scratch_size)
{
    uint32_t data_size = 0;
    memset(m, 0, sizeof *m);
    if (((uintptr_t)blob & 3u) != 0u) {
        return QS_ERR_ARG; /* int32 arrays are read in place */
    }
    qs_status st = read_header(m, blob, len, &data_size);
    if (st != QS_OK) {
        return st;
    }
    const uint8_t *tensors = blob + QS_BLOB_HEADER_SIZE + QS_BLOB_TABLE_SIZE;
    const uint8_t *ops = tensors + m->n_tensors * QS_BLOB_TENSOR_SIZE;
    const data_section d = {(uint8_t *)(uintptr_t)(ops + m->n_ops * QS_BLOB_OP_SIZE), data_size};
    st = read_tensors(m, tensors);
    if (st == QS_OK) {
        st = read_ops(m, ops, &d);
    }
    if (st != QS_OK) {
        return st;
    }
    const qs_tensor *out = &m->tensors[m->output];
    if (out->size != m->num_classes) {
        return QS_ERR_ARG;
    }
    /* One arena slot per tensor (a sample at a time keeps the slots small). 256 tensors
     * of up to 2^24 elements could pass 2^32: sum in 64 bits, then compare. */
    uint64_t arena = 0;
    for (uint32_t i = 0; i < m->n_tensors; ++i) {
        m->tensors[i].arena_offset = (uint32_t)arena;
        arena += (m->tensors[i].size + 3u) & ~3u;
        if (arena > scratch_size) {
            return QS_ERR_TOO_LARGE;
        }
    }
    m->blob = blob;
    m->blob_len = len;
    m->arena = scratch;
    m->arena_size = (size_t)arena;
    return QS_OK;
}

static int8_t *slot(qs_model *m, uint32_t tensor)
{
    return m->arena + m->tensors[tensor].arena_offset;
}

static void run_op(qs_model *m, qs_op *op, const int8_t *flat)
{
    const int8_t *in = slot(m, op->in0);
    int8_t *out = slot(m, op->out);
    const int8_t *w = (flat != NULL && op->trainable) ? flat + op->param_offset : op->weight;
    switch (op->opcode) {
    case QS_OP_CONV:
        qs_conv_s8(&op->conv, op->rq, op->in_shape, in, op->filter_shape, w, op->bias, op->out_shape, out);
        break;
    case QS_OP_DEPTHWISE:
        qs_depthwise_s8(&op->conv, op->rq, op->in_shape, in, op->filter_shape, w, op->bias, op->out_shape, out);
        break;
    case QS_OP_DENSE:
        qs_fc_s8(&op->fc, op->rq, 1, (int32_t)m->tensors[op->in0].size, (int32_t)m->tensors[op->out].size, in, w,
                 op->bias, out);
        break;
    case QS_OP_AVGPOOL:
    case QS_OP_GLOBALAVG: qs_avgpool_s8(&op->pool, op->in_shape, in, op->out_shape, out); break;
    case QS_OP_MAXPOOL: qs_maxpool_s8(&op->pool, op->in_shape, in, op->out_shape, out); break;
    case QS_OP_RELU:
    case QS_OP_RELU6: qs_requant_s8(&op->relu, (int32_t)m->tensors[op->out].size, in, out); break;
    case QS_OP_ADD: qs_add_s8(&op->add, (int32_t)m->tensors[op->out].size, in, slot(m, op->in1), out); break;
    case QS_OP_MEAN: qs_mean_s8(&op->mean, op->in_shape, in, out); break;
    case QS_OP_PAD: qs_pad_s8(&op->pad, op->in_shape, in, out); break;
    case QS_OP_MUL: qs_mul_s8(&op->mul, in, slot(m, op->in1), out); break;
    case QS_OP_LOGISTIC:
    case QS_OP_HARD_SWISH:
    case QS_OP_MUL_CONSTANT: qs_lut_s8(op->table, m->tensors[op->out].size, in, out); break;
    case QS_OP_CONCAT:
        qs_concat_s8(m->tensors[op->out].size / (op->concat_a + op->concat_b), op->concat_a, in, op->concat_b,
                     slot(m, op->in1), out);
        break;
    default: memcpy(out, in, m->tensors[op->out].size); break; /* RESHAPE */
    }
}

const int8_t *qs_model_forward(qs_model *m, const int8_t *input, const int8_t *flat)
{
    memcpy(slot(m, m->input), input, m->tensors[m->input].size);
    for (uint32_t i = 0; i < m->n_ops; ++i) {
        run_op(m, &m->ops[i], flat);
    }
    return slot(m, m->output);
}

uint32_t qs_model_trainable_channels(const qs_model *m)
{
    uint32_t channels = 0;
    for (uint32_t i = 0; i < m->n_ops; ++i) {
        channels += m->ops[i].trainable ? m->ops[i].channels : 0u;
    }
    return channels;
}

void qs_model_use_channels(qs_model *m, const int32_t *shift, const int32_t *bias, const float *scales)
{
    uint32_t first = 0;
    for (uint32_t i = 0; i < m->n_ops; ++i) {
        qs_op *op = &m->ops[i];
        if (op->trainable) {
            op->rq.shift = shift + first;
            op->bias = bias + first;
            op->scales = scales + first;
            first += op->channels;
        }
    }
}

void qs_model_get_flat(const qs_model *m, int8_t *flat)
{
    for (uint32_t i = 0; i < m->n_ops; ++i) {
        const qs_op *op = &m->ops[i];
        if (op->trainable) {
            memcpy(flat + op->param_offset, op->weight, op->weight_count);
        }
    }
}
