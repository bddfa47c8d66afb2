#include "codec.h"

#include <string.h>

/* F_PER_K: one value per key; F_PER_K_TWO: the same, two-sided only; F_ONE_SIDED: one
 * value, one-sided only. Their values are float32 or u64 (field.elem). */
typedef enum {
    F_U8, F_U16, F_U32, F_U64, F_F32, F_F64, F_ENUM, F_TEXT, F_BLOB, F_KSET, F_PER_K, F_PER_K_TWO, F_ONE_SIDED
} kind;
typedef enum { T_NAME, T_VERSION, T_DETAIL } text_class;

typedef struct {
    const char *name;
    size_t offset;               /* into qs_msg */
    const char *const *choices;  /* F_ENUM */
    kind kind;
    kind elem;                   /* F_PER_K, F_PER_K_TWO, F_ONE_SIDED: F_F32 or F_U64 */
    text_class text;             /* F_TEXT */
    uint16_t most;               /* F_TEXT: longest, in bytes; F_KSET: most keys */
    uint8_t nchoices;            /* F_ENUM */
} field;

static const char *const kEstimator[] = {"two_sided", "one_sided"};
static const char *const kNumerics[] = {"fp32", "int8"};
static const char *const kAccumulator[] = {"fp16", "int8"};
static const char *const kLrUnit[] = {"int8_step", "weight"};
static const char *const kNpu[] = {"none", "neural_art", "virtual"};
static const char *const kState[] = {"idle", "loading", "ready", "busy", "fault"};
static const char *const kResource[] = {"model", "weights", "dataset", "job_config"};
static const char *const kScope[] = {"soft", "hard"};
static const char *const kErrorCode[] = {
    "internal", "unsupported_version", "malformed", "unknown_type", "unknown_job", "stale_step", "not_ready",
    "busy", "crc_mismatch", "too_large", "no_memory", "numeric", "dataset_missing", "model_invalid"};

#define N(a) ((uint8_t)(sizeof(a) / sizeof((a)[0])))
#define OFF(m) offsetof(qs_msg, m)
#define SCALAR(n, k, m) {n, OFF(m), NULL, k, F_U8, T_NAME, 0, 0}
#define ENUM(n, m, c) {n, OFF(m), c, F_ENUM, F_U8, T_NAME, 0, N(c)}
#define TEXT(n, m, len, cls) {n, OFF(m), NULL, F_TEXT, F_U8, cls, len, 0}
#define VALUES(n, k, m, e) {n, OFF(m), NULL, k, e, T_NAME, 0, 0}
#define JOB SCALAR("job_id", F_U32, job_id)
#define STEP SCALAR("step", F_U32, step)
#define KSET_OF(most) {"ks", 0, NULL, F_KSET, F_U8, T_NAME, most, 0}
#define KSET KSET_OF(QS_MAX_KS)
#define BLOB {"chunk", 0, NULL, F_BLOB, F_U8, T_NAME, 0, 0}
#define END {NULL, 0, NULL, F_U8, F_U8, T_NAME, 0, 0}

static const field kHello[] = {
    SCALAR("protocol_version", F_U16, protocol_version), ENUM("npu", npu, kNpu),
    SCALAR("ram_kib", F_U32, ram_kib), SCALAR("max_batch", F_U16, max_batch),
    SCALAR("max_payload", F_U32, max_payload), SCALAR("model_hash", F_U64, model_hash),
    SCALAR("dataset_hash", F_U64, dataset_hash), TEXT("board_id", text_a, 32, T_NAME),
    TEXT("firmware_version", text_b, 24, T_VERSION), END};
static const field kHeartbeat[] = {
    SCALAR("nonce", F_U32, nonce), SCALAR("uptime_ms", F_U32, uptime_ms), ENUM("state", state, kState), JOB,
    STEP, END};
static const field kEvalResult[] = {
    JOB, STEP, SCALAR("compute_us", F_U32, compute_us), ENUM("estimator", estimator, kEstimator), KSET,
    VALUES("loss_plus", F_PER_K, seq_a, F_F32), VALUES("loss_minus", F_PER_K_TWO, seq_b, F_F32),
    VALUES("loss_zero", F_ONE_SIDED, loss_zero, F_F32), END};
static const field kEvalSliceResult[] = {
    JOB, STEP, SCALAR("compute_us", F_U32, compute_us), ENUM("estimator", estimator, kEstimator),
    SCALAR("slice_start", F_U16, slice_start), SCALAR("slice_count", F_U16, slice_count), KSET_OF(QS_MAX_SLICE_KS),
    VALUES("sum_plus", F_PER_K, sum_plus, F_U64), VALUES("sum_minus", F_PER_K_TWO, sum_minus, F_U64),
    VALUES("sum_zero", F_ONE_SIDED, sum_zero, F_U64), END};
static const field kUpdateAck[] = {JOB, STEP, SCALAR("checksum", F_U32, checksum), END};
static const field kValidateResult[] = {
    JOB, STEP, SCALAR("start", F_U32, start), SCALAR("count", F_U32, count), SCALAR("loss_sum", F_F64, loss_sum),
    SCALAR("correct", F_U32, correct), SCALAR("compute_us", F_U32, compute_us), END};
static const field kLoaded[] = {
    ENUM("resource", resource, kResource), JOB, SCALAR("crc32", F_U32, crc32), SCALAR("size", F_U32, size), END};
static const field kError[] = {
    ENUM("code", code, kErrorCode), SCALAR("ref_type", F_U8, ref_type), JOB, STEP,
    TEXT("detail", text_a, 64, T_DETAIL), END};
static const field kLoadModel[] = {
    SCALAR("total", F_U32, total), SCALAR("offset", F_U32, offset), SCALAR("crc32", F_U32, crc32),
    BLOB, END};
static const field kSetWeights[] = {
    SCALAR("total", F_U32, total), SCALAR("offset", F_U32, offset), JOB, STEP, SCALAR("checksum", F_U32, checksum),
    BLOB, END};
static const field kSelectDataset[] = {
    TEXT("name", text_a, 32, T_NAME), SCALAR("dataset_hash", F_U64, dataset_hash),
    SCALAR("train_size", F_U32, train_size), SCALAR("val_size", F_U32, val_size), END};
static const field kJobConfig[] = {
    JOB, SCALAR("seed", F_U64, seed), ENUM("numerics", numerics, kNumerics), ENUM("estimator", estimator, kEstimator),
    ENUM("accumulator", accumulator, kAccumulator), SCALAR("batch_size", F_U16, batch_size),
    SCALAR("eps", F_F32, eps), ENUM("lr_unit", lr_unit, kLrUnit),
    SCALAR("recalibrate_every", F_U32, recalibrate_every), END};
static const field kEvalRequest[] = {
    JOB, STEP, SCALAR("batch_size", F_U16, batch_size), SCALAR("eps", F_F32, eps),
    ENUM("estimator", estimator, kEstimator), KSET, END};
static const field kEvalSliceRequest[] = {
    JOB, STEP, SCALAR("batch_size", F_U16, batch_size), SCALAR("eps", F_F32, eps),
    ENUM("estimator", estimator, kEstimator), SCALAR("slice_start", F_U16, slice_start),
    SCALAR("slice_count", F_U16, slice_count), KSET_OF(QS_MAX_SLICE_KS), END};
static const field kApplyUpdate[] = {JOB, STEP, KSET, VALUES("coefficients", F_PER_K, seq_a, F_F32), END};
static const field kValidateRequest[] = {JOB, STEP, SCALAR("start", F_U32, start), SCALAR("count", F_U32, count), END};
static const field kPing[] = {SCALAR("nonce", F_U32, nonce), END};
static const field kReset[] = {ENUM("scope", scope, kScope), END};

typedef struct {
    uint8_t code;
    const char *name;
    const field *fields;
} layout;

static const layout kLayouts[] = {
    {QS_MSG_HELLO, "hello", kHello},
    {QS_MSG_HEARTBEAT, "heartbeat", kHeartbeat},
    {QS_MSG_EVAL_RESULT, "eval_result", kEvalResult},
    {QS_MSG_UPDATE_ACK, "update_ack", kUpdateAck},
    {QS_MSG_VALIDATE_RESULT, "validate_result", kValidateResult},
    {QS_MSG_LOADED, "loaded", kLoaded},
    {QS_MSG_EVAL_SLICE_RESULT, "eval_slice_result", kEvalSliceResult},
    {QS_MSG_LOAD_MODEL, "load_model", kLoadModel},
    {QS_MSG_SET_WEIGHTS, "set_weights", kSetWeights},
    {QS_MSG_SELECT_DATASET, "select_dataset", kSelectDataset},
    {QS_MSG_JOB_CONFIG, "job_config", kJobConfig},
    {QS_MSG_EVAL_REQUEST, "eval_request", kEvalRequest},
    {QS_MSG_APPLY_UPDATE, "apply_update", kApplyUpdate},
    {QS_MSG_VALIDATE_REQUEST, "validate_request", kValidateRequest},
    {QS_MSG_PING, "ping", kPing},
    {QS_MSG_RESET, "reset", kReset},
    {QS_MSG_EVAL_SLICE_REQUEST, "eval_slice_request", kEvalSliceRequest},
    {QS_MSG_ERROR, "error", kError},
};

static const layout *find_layout(uint8_t code)
{
    for (size_t i = 0; i < sizeof kLayouts / sizeof kLayouts[0]; ++i) {
        if (kLayouts[i].code == code) {
            return &kLayouts[i];
        }
    }
    return NULL;
}

const char *qs_msg_type_name(uint8_t type)
{
    const layout *l = find_layout(type);
    return l ? l->name : NULL;
}

void qs_msg_init(qs_msg *msg, uint8_t type)
{
    memset(msg, 0, sizeof *msg);
    msg->type = type;
    msg->protocol_version = QS_PROTOCOL_VERSION;
    msg->max_payload = QS_MAX_PAYLOAD;
}

const char *qs_decode_error_name(qs_decode_error err)
{
    static const char *const names[] = {"ok", "truncated", "oversized", "trailing_bytes", "bad_magic",
                                        "unsupported_version", "unknown_type", "invalid_field"};
    return (unsigned)err < sizeof names / sizeof names[0] ? names[err] : "internal";
}

/* ---- little-endian helpers ---- */

static uint64_t get_le(const uint8_t *p, unsigned n)
{
    uint64_t v = 0;
    for (unsigned i = 0; i < n; ++i) {
        v |= (uint64_t)p[i] << (8u * i);
    }
    return v;
}

static void put_le(uint8_t *p, uint64_t v, unsigned n)
{
    for (unsigned i = 0; i < n; ++i) {
        p[i] = (uint8_t)(v >> (8u * i));
    }
}

static float f32_of(uint32_t bits)
{
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static uint32_t bits_f32(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static int finite_f32(uint32_t bits)
{
    return ((bits >> 23) & 0xFFu) != 0xFFu;
}

static int text_ok(const char *s, size_t n, text_class cls)
{
    if (cls != T_DETAIL && n == 0u) {
        return 0;
    }
    for (size_t i = 0; i < n; ++i) {
        const unsigned char c = (unsigned char)s[i];
        if (cls == T_NAME) {
            if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
                  c == '.' || c == '-')) {
                return 0;
            }
        } else if (c < (cls == T_VERSION ? 0x21u : 0x20u) || c > 0x7Eu) {
            return 0;
        }
    }
    return 1;
}

static int ascii_only(const uint8_t *s, size_t n)
{
    for (size_t i = 0; i < n; ++i) {
        if (s[i] >= 0x80u) {
            return 0;
        }
    }
    return 1;
}

/* ---- decode ---- */

typedef struct {
    const uint8_t *data;
    size_t len, pos;
    qs_decode_error err;
    const char *detail;
    const char *deferred; /* the first value check that failed: reported after the walk */
} reader;

static const uint8_t *take(reader *r, size_t n)
{
    if (r->err != QS_DEC_OK) {
        return NULL;
    }
    if (n > r->len - r->pos) {
        r->err = QS_DEC_TRUNCATED;
        r->detail = "message shorter than its layout";
        return NULL;
    }
    const uint8_t *p = r->data + r->pos;
    r->pos += n;
    return p;
}

static void invalid(reader *r, const char *detail)
{
    if (r->err == QS_DEC_OK) {
        r->err = QS_DEC_INVALID_FIELD;
        r->detail = detail;
    }
}

/* A value check (text pattern, float finiteness, k range and order) is reported only once
 * the walk found the layout whole and nothing after it (SPEC 6.4): a truncated message is
 * `truncated` even if a text in it is also wrong. */
static void defer(reader *r, const char *detail)
{
    if (r->deferred == NULL) {
        r->deferred = detail;
    }
}

static void decode_scalar(reader *r, const field *f, qs_msg *m)
{
    static const unsigned sizes[] = {1, 2, 4, 8, 4, 8};
    const unsigned n = sizes[f->kind];
    const uint8_t *p = take(r, n);
    if (p == NULL) {
        return;
    }
    const uint64_t v = get_le(p, n);
    uint8_t *dst = (uint8_t *)m + f->offset;
    switch (f->kind) {
    case F_U8: *dst = (uint8_t)v; break;
    case F_U16: { uint16_t x = (uint16_t)v; memcpy(dst, &x, 2); } break;
    case F_U32: { uint32_t x = (uint32_t)v; memcpy(dst, &x, 4); } break;
    case F_U64: memcpy(dst, &v, 8); break;
    case F_F32: {
        if (!finite_f32((uint32_t)v)) {
            defer(r, "float field is not finite");
        }
        const float x = f32_of((uint32_t)v);
        memcpy(dst, &x, 4);
    } break;
    default: {
        if (((v >> 52) & 0x7FFu) == 0x7FFu) {
            defer(r, "float field is not finite");
        }
        double x;
        memcpy(&x, &v, 8);
        memcpy(dst, &x, 8);
    } break;
    }
}

static void decode_kset(reader *r, qs_msg *m, uint16_t most)
{
    const uint8_t *p = take(r, 3);
    if (p == NULL) {
        return;
    }
    const uint8_t mode = p[0];
    const uint16_t count = (uint16_t)get_le(p + 1, 2);
    if (count < 1u || count > most) {
        invalid(r, most == QS_MAX_KS ? "k count outside [1, MAX_KS]" : "k count outside [1, MAX_SLICE_KS]");
        return;
    }
    m->nks = count;
    if (mode == 0u) {
        const uint8_t *s = take(r, 2);
        if (s == NULL) {
            return;
        }
        const uint32_t start = (uint32_t)get_le(s, 2);
        if (start + count - 1u > 0xFFFFu) {
            defer(r, "k range runs past 65535");
        }
        for (uint16_t i = 0; i < count; ++i) {
            m->ks[i] = (uint16_t)(start + i);
        }
    } else if (mode == 1u) {
        const uint8_t *s = take(r, 2u * count);
        if (s == NULL) {
            return;
        }
        for (uint16_t i = 0; i < count; ++i) {
            m->ks[i] = (uint16_t)get_le(s + 2u * i, 2);
            if (i > 0u && m->ks[i] <= m->ks[i - 1]) {
                defer(r, "sample keys not strictly ascending");
            }
        }
    } else {
        invalid(r, "k set mode is not defined");
    }
}

static unsigned elem_size(kind elem)
{
    return elem == F_U64 ? 8u : 4u;
}

/* How many values a per-key or one-sided field has in m (its estimator and keys). */
static uint16_t value_count(const field *f, const qs_msg *m)
{
    const int two_sided = m->estimator == QS_EST_TWO_SIDED;
    switch (f->kind) {
    case F_PER_K: return m->nks;
    case F_PER_K_TWO: return two_sided ? m->nks : 0u;
    default: return two_sided ? 0u : 1u;
    }
}

/* n values (float32 or u64, f->elem) into the field's array. */
static void decode_values(reader *r, const field *f, qs_msg *m, uint16_t n)
{
    const unsigned size = elem_size(f->elem);
    const uint8_t *p = take(r, (size_t)size * n);
    uint8_t *dst = (uint8_t *)m + f->offset;
    for (uint16_t i = 0; p != NULL && i < n; ++i) {
        const uint64_t v = get_le(p + size * i, size);
        if (f->elem == F_U64) {
            memcpy(dst + 8u * i, &v, 8);
            continue;
        }
        if (!finite_f32((uint32_t)v)) {
            defer(r, "float field is not finite");
        }
        const float x = f32_of((uint32_t)v);
        memcpy(dst + 4u * i, &x, 4);
    }
}

static void decode_field(reader *r, const field *f, qs_msg *m)
{
    switch (f->kind) {
    case F_ENUM: {
        const uint8_t *p = take(r, 1);
        if (p != NULL) {
            if (*p >= f->nchoices) {
                invalid(r, "enum code is not defined");
            }
            *((uint8_t *)m + f->offset) = *p;
        }
    } break;
    case F_TEXT: {
        const uint8_t *p = take(r, 1);
        const uint8_t n = p ? *p : 0u;
        if (p != NULL && n > f->most) {
            invalid(r, "text field too long");
            return;
        }
        const uint8_t *s = take(r, n);
        if (s != NULL) {
            char *dst = (char *)m + f->offset;
            memcpy(dst, s, n);
            dst[n] = '\0';
            if (!ascii_only(s, n)) {
                invalid(r, "text field is not ASCII"); /* not text at all: at once */
            } else if (!text_ok(dst, n, f->text)) {
                defer(r, "text field has characters outside its pattern");
            }
        }
    } break;
    case F_BLOB: {
        const uint8_t *p = take(r, 2);
        const uint16_t n = p ? (uint16_t)get_le(p, 2) : 0u;
        if (p != NULL && n > QS_MAX_CHUNK) {
            invalid(r, "chunk larger than MAX_CHUNK");
            return;
        }
        m->chunk = take(r, n);
        m->chunk_len = n;
    } break;
    case F_KSET: decode_kset(r, m, f->most); break;
    case F_PER_K: case F_PER_K_TWO: case F_ONE_SIDED: decode_values(r, f, m, value_count(f, m)); break;
    default: decode_scalar(r, f, m); break;
    }
}

/* Cross-field rules of the pydantic models. */
static void check_message(reader *r, const qs_msg *m)
{
    if ((m->type == QS_MSG_LOAD_MODEL || m->type == QS_MSG_SET_WEIGHTS) &&
        (uint64_t)m->offset + m->chunk_len > m->total) {
        invalid(r, "chunk runs past the total length");
    }
    if (m->type == QS_MSG_VALIDATE_REQUEST && m->count == 0u) {
        invalid(r, "count must be at least 1");
    }
    if (m->type == QS_MSG_VALIDATE_RESULT && m->correct > m->count) {
        invalid(r, "correct exceeds count");
    }
    const int slice = m->type == QS_MSG_EVAL_SLICE_REQUEST || m->type == QS_MSG_EVAL_SLICE_RESULT;
    if (slice && m->slice_count == 0u) {
        invalid(r, "slice_count must be at least 1");
    }
    if (m->type == QS_MSG_EVAL_SLICE_REQUEST && (uint32_t)m->slice_start + m->slice_count > m->batch_size) {
        invalid(r, "the slice ends after the batch");
    }
}

qs_status qs_decode(const uint8_t *data, size_t len, qs_msg *msg, qs_decode_error *err, const char **detail)
{
    reader r = {data, len, QS_HEADER_SIZE, QS_DEC_OK, NULL, NULL};
    const layout *l = NULL;
    if (len > QS_MAX_PAYLOAD) {
        r.err = QS_DEC_OVERSIZED;
        r.detail = "message larger than MAX_PAYLOAD";
    } else if (len < QS_HEADER_SIZE) {
        r.err = QS_DEC_TRUNCATED;
        r.detail = "shorter than a header";
    } else if (data[0] != 'Q' || data[1] != 'S') {
        r.err = QS_DEC_BAD_MAGIC;
        r.detail = "header does not start with QS";
    } else if (data[2] != QS_PROTOCOL_VERSION) {
        r.err = QS_DEC_UNSUPPORTED_VERSION;
        r.detail = "protocol 1 required";
    } else if ((l = find_layout(data[3])) == NULL) {
        r.err = QS_DEC_UNKNOWN_TYPE;
        r.detail = "type code is not defined";
    }
    if (r.err == QS_DEC_OK) {
        qs_msg_init(msg, data[3]);
        for (const field *f = l->fields; f->name != NULL && r.err == QS_DEC_OK; ++f) {
            decode_field(&r, f, msg);
        }
        if (r.err == QS_DEC_OK && r.pos != len) {
            r.err = QS_DEC_TRAILING_BYTES;
            r.detail = "bytes after the message";
        }
        if (r.deferred != NULL) {
            invalid(&r, r.deferred);
        }
        if (r.err == QS_DEC_OK) {
            check_message(&r, msg);
        }
    }
    if (err != NULL) {
        *err = r.err;
    }
    if (detail != NULL) {
        *detail = r.detail;
    }
    return r.err == QS_DEC_OK ? QS_OK : QS_ERR_FORMAT;
}

/* ---- encode ---- */

typedef struct {
    uint8_t *out;
    size_t cap, pos;
    int overflow;
} writer;

static uint8_t *room(writer *w, size_t n)
{
    if (w->overflow || n > w->cap - w->pos) {
        w->overflow = 1;
        return NULL;
    }
    uint8_t *p = w->out + w->pos;
    w->pos += n;
    return p;
}

static void put(writer *w, uint64_t v, unsigned n)
{
    uint8_t *p = room(w, n);
    if (p != NULL) {
        put_le(p, v, n);
    }
}

/* Value i of a per-key or one-sided field at src: a u64, or a float32's bits. */
static uint64_t value_at(const field *f, const uint8_t *src, uint16_t i)
{
    if (f->elem == F_U64) {
        uint64_t v;
        memcpy(&v, src + 8u * i, 8);
        return v;
    }
    float x;
    memcpy(&x, src + 4u * i, 4);
    return bits_f32(x);
}

static void encode_field(writer *w, const field *f, const qs_msg *m)
{
    const uint8_t *src = (const uint8_t *)m + f->offset;
    switch (f->kind) {
    case F_U8: case F_ENUM: put(w, *src, 1); break;
    case F_U16: { uint16_t x; memcpy(&x, src, 2); put(w, x, 2); } break;
    case F_U32: case F_F32: { uint32_t x; memcpy(&x, src, 4); put(w, x, 4); } break;
    case F_U64: case F_F64: { uint64_t x; memcpy(&x, src, 8); put(w, x, 8); } break;
    case F_TEXT: {
        const size_t n = strlen((const char *)src);
        put(w, n > f->most ? f->most : n, 1);
        uint8_t *p = room(w, n > f->most ? f->most : n);
        if (p != NULL) {
            memcpy(p, src, n > f->most ? f->most : n);
        }
    } break;
    case F_BLOB: {
        put(w, m->chunk_len, 2);
        uint8_t *p = room(w, m->chunk_len);
        if (p != NULL && m->chunk_len != 0u) {
            memcpy(p, m->chunk, m->chunk_len);
        }
    } break;
    case F_KSET: {
        const int range = m->nks > 0u && (uint32_t)m->ks[m->nks - 1u] - m->ks[0] + 1u == m->nks;
        put(w, range ? 0u : 1u, 1);
        put(w, m->nks, 2);
        for (uint16_t i = 0; i < (range ? 1u : m->nks); ++i) {
            put(w, m->ks[i], 2);
        }
    } break;
    case F_PER_K: case F_PER_K_TWO: case F_ONE_SIDED:
        for (uint16_t i = 0; i < value_count(f, m); ++i) {
            put(w, value_at(f, src, i), elem_size(f->elem));
        }
        break;
    }
}

qs_status qs_encode(const qs_msg *msg, uint8_t *out, size_t cap, size_t *len)
{
    const layout *l = find_layout(msg->type);
    if (l == NULL) {
        return QS_ERR_ARG;
    }
    for (const field *f = l->fields; f->name != NULL; ++f) {
        if (f->kind == F_KSET && msg->nks > f->most) {
            return QS_ERR_ARG; /* a slice message's sums have room for 512 keys only */
        }
    }
    writer w = {out, cap < QS_MAX_PAYLOAD ? cap : QS_MAX_PAYLOAD, 0, 0};
    uint8_t *h = room(&w, QS_HEADER_SIZE);
    if (h != NULL) {
        h[0] = 'Q';
        h[1] = 'S';
        h[2] = QS_PROTOCOL_VERSION;
        h[3] = msg->type;
    }
    for (const field *f = l->fields; f->name != NULL; ++f) {
        encode_field(&w, f, msg);
    }
    if (w.overflow) {
        return QS_ERR_TOO_LARGE;
    }
    *len = w.pos;
    return QS_OK;
}

/* ---- field text (test vectors) ---- */

/* A bounded text builder (no printf: newlib-nano's needs a heap). */
typedef struct {
    char *out;
    size_t cap, len;
    int overflow;
} text_buf;

static void tb_char(text_buf *t, char c)
{
    if (t->len + 1u >= t->cap) {
        t->overflow = 1;
        return;
    }
    t->out[t->len++] = c;
    t->out[t->len] = '\0';
}

static void tb_str(text_buf *t, const char *s)
{
    while (*s != '\0') {
        tb_char(t, *s++);
    }
}

/* v in base 10 or 16, zero-padded to width digits. */
static void tb_u64(text_buf *t, uint64_t v, unsigned base, unsigned width)
{
    char tmp[24];
    unsigned n = 0;
    do {
        tmp[n++] = "0123456789abcdef"[v % base];
        v /= base;
    } while (v != 0u);
    while (n < width) {
        tmp[n++] = '0';
    }
    while (n > 0u) {
        tb_char(t, tmp[--n]);
    }
}

/* Comma-separated: float32 values as their bits in hex, u64 values in decimal. */
static void tb_values(text_buf *t, const field *f, const uint8_t *src, uint16_t n)
{
    for (uint16_t i = 0; i < n; ++i) {
        if (i != 0u) {
            tb_char(t, ',');
        }
        if (f->elem == F_U64) {
            tb_u64(t, value_at(f, src, i), 10, 0);
        } else {
            tb_str(t, "0x");
            tb_u64(t, value_at(f, src, i), 16, 8);
        }
    }
}

int qs_msg_field_text(const qs_msg *msg, const char *name, char *out, size_t cap)
{
    const layout *l = find_layout(msg->type);
    if (l == NULL || cap == 0u) {
        return 0;
    }
    text_buf t = {out, cap, 0, 0};
    out[0] = '\0';
    for (const field *f = l->fields; f->name != NULL; ++f) {
        if (strcmp(f->name, name) != 0) {
            continue;
        }
        const uint8_t *src = (const uint8_t *)msg + f->offset;
        uint16_t u16;
        uint32_t u32;
        uint64_t u64;
        switch (f->kind) {
        case F_U8: tb_u64(&t, *src, 10, 0); break;
        case F_U16: memcpy(&u16, src, 2); tb_u64(&t, u16, 10, 0); break;
        case F_U32: memcpy(&u32, src, 4); tb_u64(&t, u32, 10, 0); break;
        case F_U64: memcpy(&u64, src, 8); tb_u64(&t, u64, 10, 0); break;
        case F_F32: memcpy(&u32, src, 4); tb_str(&t, "0x"); tb_u64(&t, u32, 16, 8); break;
        case F_F64: memcpy(&u64, src, 8); tb_str(&t, "0x"); tb_u64(&t, u64, 16, 16); break;
        case F_ENUM: tb_str(&t, *src < f->nchoices ? f->choices[*src] : "?"); break;
        case F_TEXT: tb_str(&t, (const char *)src); break;
        case F_BLOB:
            for (uint16_t i = 0; i < msg->chunk_len; ++i) {
                tb_u64(&t, msg->chunk[i], 16, 2);
            }
            break;
        case F_KSET:
            for (uint16_t i = 0; i < msg->nks; ++i) {
                if (i != 0u) {
                    tb_char(&t, ',');
                }
                tb_u64(&t, msg->ks[i], 10, 0);
            }
            break;
        case F_PER_K: case F_PER_K_TWO: case F_ONE_SIDED: tb_values(&t, f, src, value_count(f, msg)); break;
        }
        return !t.overflow;
    }
    return 0;
}
