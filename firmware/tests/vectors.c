#include "vectors.h"

#include <string.h>

#include "cobs.h"
#include "crc32.h"
#include "fp16.h"
#include "loss.h"
#include "prng.h"

/* A cursor over one line's whitespace-separated fields. */
typedef struct {
    const char *p;
    const char *end;
} fields;

static int next_field(fields *f, const char **start, size_t *len)
{
    while (f->p < f->end && (*f->p == ' ' || *f->p == '\t' || *f->p == '\r')) {
        ++f->p;
    }
    if (f->p >= f->end) {
        return 0;
    }
    *start = f->p;
    while (f->p < f->end && *f->p != ' ' && *f->p != '\t' && *f->p != '\r') {
        ++f->p;
    }
    *len = (size_t)(f->p - *start);
    return 1;
}

static int hex_digit(char c)
{
    if (c >= '0' && c <= '9') {
        return c - '0';
    }
    if (c >= 'a' && c <= 'f') {
        return c - 'a' + 10;
    }
    if (c >= 'A' && c <= 'F') {
        return c - 'A' + 10;
    }
    return -1;
}

static int parse_u64(fields *f, int base, uint64_t *out)
{
    const char *s;
    size_t n;
    if (!next_field(f, &s, &n) || n > (base == 16 ? 16u : 20u)) {
        return 0;
    }
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) {
        const int d = hex_digit(s[i]);
        if (d < 0 || d >= base) {
            return 0;
        }
        v = v * (uint64_t)base + (uint64_t)d;
    }
    *out = v;
    return 1;
}

static int parse_u32(fields *f, int base, uint32_t *out)
{
    uint64_t v;
    if (!parse_u64(f, base, &v) || v > UINT32_MAX) {
        return 0;
    }
    *out = (uint32_t)v;
    return 1;
}

/* Hex bytes (two digits each; "-" for none) into out (cap bytes). */
static int parse_bytes(fields *f, uint8_t *out, size_t cap, size_t *len)
{
    const char *s;
    size_t n;
    if (!next_field(f, &s, &n)) {
        return 0;
    }
    if (n == 1 && s[0] == '-') {
        *len = 0;
        return 1;
    }
    if (n % 2u != 0u || n / 2u > cap) {
        return 0;
    }
    for (size_t i = 0; i < n / 2u; ++i) {
        const int hi = hex_digit(s[2 * i]), lo = hex_digit(s[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            return 0;
        }
        out[i] = (uint8_t)(hi * 16 + lo);
    }
    *len = n / 2u;
    return 1;
}

static float f32_from_bits(uint32_t bits)
{
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* The most recent "table" line, which "loss" lines of the same scale refer to. */
static struct {
    uint32_t scale_bits;
    int valid;
    qs_loss_params params;
} g_table;

static int run_table(fields *f)
{
    uint32_t scale_bits, s;
    if (!parse_u32(f, 16, &scale_bits) || !parse_u32(f, 10, &s)) {
        return 0;
    }
    g_table.valid = 0;
    g_table.scale_bits = scale_bits;
    g_table.params.scale_q24 = s;
    for (uint32_t d = 0; d < QS_LOSS_TABLE_SIZE; ++d) {
        if (!parse_u32(f, 16, &g_table.params.exp_table[d])) {
            return 0;
        }
    }
    g_table.valid = qs_loss_check(&g_table.params) == QS_OK;
    return g_table.valid;
}

static int run_log2(fields *f)
{
    uint64_t v, expect;
    if (!parse_u64(f, 16, &v) || !parse_u64(f, 10, &expect) || v == 0u || v >= (1ull << 62)) {
        return 0;
    }
    return qs_ilog2_q24(v) == expect;
}

static int run_loss(fields *f)
{
    uint32_t scale_bits, label, expect;
    uint8_t logits[QS_LOSS_MAX_CLASSES];
    size_t classes;
    if (!parse_u32(f, 16, &scale_bits) || !parse_bytes(f, logits, sizeof logits, &classes) ||
        !parse_u32(f, 10, &label) || !parse_u32(f, 10, &expect)) {
        return 0;
    }
    if (!g_table.valid || g_table.scale_bits != scale_bits || classes == 0u || label >= classes) {
        return 0;
    }
    return (uint32_t)qs_loss_q16((const int8_t *)logits, (uint32_t)classes, label, &g_table.params) == expect;
}

/* philox <c0> <c1> <c2> <c3> <k0> <k1> <out0> <out1> <out2> <out3>, all hex words. */
static int run_philox(fields *f)
{
    uint32_t in[6], expect[4], out[4];
    for (int i = 0; i < 6; ++i) {
        if (!parse_u32(f, 16, &in[i])) {
            return 0;
        }
    }
    for (int i = 0; i < 4; ++i) {
        if (!parse_u32(f, 16, &expect[i])) {
            return 0;
        }
    }
    qs_philox4x32(in, in + 4, out);
    return memcmp(out, expect, sizeof out) == 0;
}

/* crc32 <bytes hex> <crc hex> */
static int run_crc32(fields *f)
{
    static uint8_t data[4096];
    size_t n;
    uint32_t expect;
    if (!parse_bytes(f, data, sizeof data, &n) || !parse_u32(f, 16, &expect)) {
        return 0;
    }
    return qs_crc32_update(0, data, n) == expect;
}

/* cobs <raw hex> <encoded hex> : both directions */
static int run_cobs(fields *f)
{
    static uint8_t raw[2048], enc[QS_COBS_MAX_ENCODED(2048u)], out[QS_COBS_MAX_ENCODED(2048u)];
    size_t nraw, nenc, nout;
    if (!parse_bytes(f, raw, sizeof raw, &nraw) || !parse_bytes(f, enc, sizeof enc, &nenc)) {
        return 0;
    }
    if (qs_cobs_encode(raw, nraw, out, sizeof out, &nout) != QS_OK || nout != nenc ||
        memcmp(out, enc, nenc) != 0) {
        return 0;
    }
    return qs_cobs_decode(enc, nenc, out, sizeof out, &nout) == QS_OK && nout == nraw &&
           memcmp(out, raw, nraw) == 0;
}

/* f16 <f32 bits hex> <f16 bits hex> */
static int run_f16(fields *f)
{
    uint32_t in, expect;
    if (!parse_u32(f, 16, &in) || !parse_u32(f, 16, &expect)) {
        return 0;
    }
    return qs_f16_from_f32(f32_from_bits(in)) == expect;
}

typedef struct {
    const char *name;
    int (*run)(fields *f);
} kind_entry;

static const kind_entry kKinds[] = {
    {"log2", run_log2},     {"table", run_table}, {"loss", run_loss}, {"philox", run_philox},
    {"crc32", run_crc32},   {"cobs", run_cobs},   {"f16", run_f16},
};

static qs_vector_kind_count *count_for(qs_vector_report *report, const char *name)
{
    for (uint32_t i = 0; i < report->nkinds; ++i) {
        if (strcmp(report->kinds[i].name, name) == 0) {
            return &report->kinds[i];
        }
    }
    if (report->nkinds == QS_VECTOR_KINDS_MAX) {
        return NULL;
    }
    qs_vector_kind_count *c = &report->kinds[report->nkinds++];
    strncpy(c->name, name, QS_VECTOR_KIND_LEN - 1);
    c->name[QS_VECTOR_KIND_LEN - 1] = '\0';
    c->passed = c->failed = 0;
    return c;
}

static int run_line(fields *f, qs_vector_report *report)
{
    const char *kind;
    size_t n;
    if (!next_field(f, &kind, &n) || kind[0] == '#') {
        return 1;
    }
    for (size_t i = 0; i < sizeof kKinds / sizeof kKinds[0]; ++i) {
        if (strlen(kKinds[i].name) == n && memcmp(kKinds[i].name, kind, n) == 0) {
            const int ok = kKinds[i].run(f);
            qs_vector_kind_count *c = count_for(report, kKinds[i].name);
            if (c != NULL) {
                ok ? ++c->passed : ++c->failed;
            }
            return ok;
        }
    }
    ++report->skipped;
    return 1;
}

uint32_t qs_vectors_run(const char *text, size_t len, qs_vector_report *report, qs_vector_fail_fn on_fail)
{
    memset(report, 0, sizeof *report);
    g_table.valid = 0;
    uint32_t failures = 0;
    uint32_t line_no = 0;
    size_t pos = 0;
    while (pos < len) {
        size_t end = pos;
        while (end < len && text[end] != '\n') {
            ++end;
        }
        ++line_no;
        fields f = {text + pos, text + end};
        if (!run_line(&f, report)) {
            ++failures;
            if (report->first_failed == 0u) {
                report->first_failed = line_no;
            }
            if (on_fail != NULL) {
                on_fail(line_no, text + pos, end - pos);
            }
        }
        pos = end + 1;
    }
    return failures;
}
