#include "vectors.h"

#include <string.h>

#include "cobs.h"
#include "codec.h"
#include "frame.h"
#include "update.h"
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

/* ---- protocol/SPEC.md section 11 format: "<group>.<case>.<field> <value>" ---- */

#define CASE_FIELDS_MAX 16
#define CASE_BYTES_MAX 16384

typedef struct {
    const char *name; /* field name (after the last dot) */
    size_t name_len;
    const char *value; /* rest of the line */
    size_t value_len;
} case_field;

typedef struct {
    const char *prefix; /* "<group>.<case>" */
    size_t prefix_len;
    size_t group_len;
    case_field fields[CASE_FIELDS_MAX];
    uint32_t n;
    int overflow;
} vcase;

static uint8_t g_bytes_a[CASE_BYTES_MAX], g_bytes_b[CASE_BYTES_MAX], g_bytes_c[CASE_BYTES_MAX];
static uint8_t g_wire[QS_MAX_WIRE_FRAME];
static qs_msg g_msg;
static qs_frame_reader g_reader;

static const case_field *get(const vcase *c, const char *name)
{
    const size_t n = strlen(name);
    for (uint32_t i = 0; i < c->n; ++i) {
        if (c->fields[i].name_len == n && memcmp(c->fields[i].name, name, n) == 0) {
            return &c->fields[i];
        }
    }
    return NULL;
}

static int value_hex(const case_field *f, uint8_t *out, size_t cap, size_t *len)
{
    if (f == NULL || f->value_len % 2u != 0u || f->value_len / 2u > cap) {
        return 0;
    }
    for (size_t i = 0; i < f->value_len / 2u; ++i) {
        const int hi = hex_digit(f->value[2 * i]), lo = hex_digit(f->value[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            return 0;
        }
        out[i] = (uint8_t)(hi * 16 + lo);
    }
    *len = f->value_len / 2u;
    return 1;
}

/* Comma-separated numbers (decimal, hex, or 0x-prefixed hex) into out. */
static int value_list(const case_field *f, int base, uint64_t *out, size_t cap, size_t *n)
{
    *n = 0;
    if (f == NULL) {
        return 0;
    }
    size_t i = 0;
    while (i < f->value_len) {
        size_t j = i;
        while (j < f->value_len && f->value[j] != ',') {
            ++j;
        }
        const char *s = f->value + i;
        size_t len = j - i;
        int b = base;
        if (len > 2 && s[0] == '0' && s[1] == 'x') {
            s += 2;
            len -= 2;
            b = 16;
        }
        fields one = {s, s + len};
        if (*n == cap || !parse_u64(&one, b, &out[*n])) {
            return 0;
        }
        ++*n;
        i = j + 1;
    }
    return 1;
}

static int value_u64(const vcase *c, const char *name, uint64_t *out)
{
    size_t n;
    return value_list(get(c, name), 10, out, 1, &n) && n == 1;
}

static int case_philox(const vcase *c)
{
    uint64_t ctr[4], key[2], want[4];
    size_t n1, n2, n3;
    if (!value_list(get(c, "counter"), 16, ctr, 4, &n1) || !value_list(get(c, "key"), 16, key, 2, &n2) ||
        !value_list(get(c, "out"), 16, want, 4, &n3) || n1 != 4 || n2 != 2 || n3 != 4) {
        return 0;
    }
    uint32_t c32[4] = {(uint32_t)ctr[0], (uint32_t)ctr[1], (uint32_t)ctr[2], (uint32_t)ctr[3]};
    uint32_t k32[2] = {(uint32_t)key[0], (uint32_t)key[1]};
    uint32_t out[4];
    qs_philox4x32(c32, k32, out);
    for (int i = 0; i < 4; ++i) {
        if (out[i] != want[i]) {
            return 0;
        }
    }
    return 1;
}

static int case_rademacher(const vcase *c)
{
    uint64_t seed, step, k, size;
    size_t nbytes;
    if (!value_u64(c, "seed", &seed) || !value_u64(c, "step", &step) || !value_u64(c, "k", &k) ||
        !value_u64(c, "size", &size) || !value_hex(get(c, "bits"), g_bytes_a, sizeof g_bytes_a, &nbytes) ||
        nbytes != (size + 7u) / 8u) {
        return 0;
    }
    uint32_t bits[4];
    for (uint64_t i = 0; i < size; ++i) {
        if (i % QS_PERTURB_BLOCK == 0u) {
            qs_perturb_bits(seed, (uint32_t)step, (uint32_t)k, (uint32_t)(i / QS_PERTURB_BLOCK), bits);
        }
        const uint32_t r = (uint32_t)(i % QS_PERTURB_BLOCK);
        const uint32_t mine = (bits[r >> 5] >> (r & 31u)) & 1u;
        if (mine != ((g_bytes_a[i / 8u] >> (i % 8u)) & 1u)) {
            return 0;
        }
    }
    return 1;
}

static int case_batch(const vcase *c)
{
    static uint64_t want[4096];
    static uint32_t got[4096];
    uint64_t seed, step, b, n;
    size_t count;
    if (!value_u64(c, "seed", &seed) || !value_u64(c, "step", &step) || !value_u64(c, "batch_size", &b) ||
        !value_u64(c, "dataset_size", &n) || !value_list(get(c, "indices"), 10, want, 4096, &count) ||
        count != b || b > 4096u || n > UINT32_MAX) {
        return 0;
    }
    if (qs_batch_indices(seed, (uint32_t)step, (uint32_t)b, (uint32_t)n, got) != QS_OK) {
        return 0;
    }
    for (size_t j = 0; j < count; ++j) {
        if (got[j] != want[j]) {
            return 0;
        }
    }
    return 1;
}

/* The (k, c_k) pairs of an update case: ks decimal list, cs float32 LE hex. */
static int case_pairs(const vcase *c, qs_pair *pairs, uint32_t cap, uint32_t *n)
{
    static uint64_t ks[QS_MAX_KS];
    size_t nk, ncs;
    if (!value_list(get(c, "ks"), 10, ks, QS_MAX_KS, &nk) || nk > cap ||
        !value_hex(get(c, "cs"), g_bytes_c, sizeof g_bytes_c, &ncs) || ncs != 4u * nk) {
        return 0;
    }
    for (size_t i = 0; i < nk; ++i) {
        const uint32_t bits = (uint32_t)g_bytes_c[4 * i] | ((uint32_t)g_bytes_c[4 * i + 1] << 8) |
                              ((uint32_t)g_bytes_c[4 * i + 2] << 16) | ((uint32_t)g_bytes_c[4 * i + 3] << 24);
        pairs[i].k = (uint32_t)ks[i];
        pairs[i].c = f32_from_bits(bits);
    }
    *n = (uint32_t)nk;
    return 1;
}

static int case_update(const vcase *c, int int8)
{
    static qs_pair pairs[QS_MAX_KS];
    static float theta[CASE_BYTES_MAX / 4];
    static uint16_t half[CASE_BYTES_MAX / 2];
    uint64_t seed, step, checksum;
    uint32_t npairs;
    size_t n, nb, ne;
    if (!value_u64(c, "seed", &seed) || !value_u64(c, "step", &step) || !value_u64(c, "checksum", &checksum) ||
        !case_pairs(c, pairs, QS_MAX_KS, &npairs)) {
        return 0;
    }
    const qs_stream s = {seed, (uint32_t)step};
    if (!int8) {
        if (!value_hex(get(c, "theta"), g_bytes_a, sizeof g_bytes_a, &n) || n % 4u != 0u ||
            !value_hex(get(c, "expected"), g_bytes_b, sizeof g_bytes_b, &ne) || ne != n) {
            return 0;
        }
        memcpy(theta, g_bytes_a, n); /* little-endian host and target */
        if (qs_apply_f32(theta, (uint32_t)(n / 4u), 0, s, pairs, npairs) != QS_OK) {
            return 0;
        }
        return memcmp(theta, g_bytes_b, n) == 0 && qs_crc32_f32(0, theta, (uint32_t)(n / 4u)) == checksum;
    }
    if (!value_hex(get(c, "weights"), g_bytes_a, sizeof g_bytes_a, &n) ||
        !value_hex(get(c, "buffer"), g_bytes_b, sizeof g_bytes_b, &nb) || nb != 2u * n) {
        return 0;
    }
    memcpy(half, g_bytes_b, nb);
    if (qs_apply_int8_fp16((int8_t *)g_bytes_a, half, (uint32_t)n, 0, s, pairs, npairs, NULL) != QS_OK ||
        !value_hex(get(c, "expected_weights"), g_bytes_b, sizeof g_bytes_b, &ne) || ne != n ||
        memcmp(g_bytes_a, g_bytes_b, n) != 0 ||
        !value_hex(get(c, "expected_buffer"), g_bytes_b, sizeof g_bytes_b, &ne) || ne != nb ||
        memcmp(half, g_bytes_b, nb) != 0) {
        return 0;
    }
    const uint32_t crc = qs_crc32_update(0, g_bytes_a, n);
    return qs_crc32_fp16(crc, half, (uint32_t)n) == checksum;
}

static int case_frame(const vcase *c)
{
    uint64_t seq, flags;
    size_t np, nw, nout;
    if (!value_u64(c, "seq", &seq) || !value_u64(c, "flags", &flags) ||
        !value_hex(get(c, "payload"), g_bytes_a, sizeof g_bytes_a, &np) ||
        !value_hex(get(c, "wire"), g_bytes_b, sizeof g_bytes_b, &nw)) {
        return 0;
    }
    if (qs_frame_encode((uint16_t)seq, (uint8_t)flags, g_bytes_a, np, g_wire, sizeof g_wire, &nout) != QS_OK ||
        nout != nw || memcmp(g_wire, g_bytes_b, nw) != 0) {
        return 0;
    }
    qs_frame fr;
    return nw >= 2u && qs_frame_decode(g_bytes_b + 1, nw - 2u, &fr) == QS_OK && fr.seq == seq &&
           fr.flags == flags && fr.len == np && memcmp(fr.payload, g_bytes_a, np) == 0;
}

/* Expected "frames": comma-separated "error" or "seq:flags:payload-hex". */
static int case_stream(const vcase *c)
{
    size_t nw;
    const case_field *want = get(c, "frames");
    if (want == NULL || !value_hex(get(c, "wire"), g_bytes_a, sizeof g_bytes_a, &nw)) {
        return 0;
    }
    static const char kHex[] = "0123456789abcdef";
    char got[512];
    size_t o = 0;
    qs_frame_reader_init(&g_reader);
    for (size_t i = 0; i < nw; ++i) {
        qs_frame fr;
        int done;
        const qs_status st = qs_frame_reader_push(&g_reader, g_bytes_a[i], &fr, &done);
        if (!done) {
            continue;
        }
        if (o + 24u + 2u * (st == QS_OK ? fr.len : 0u) >= sizeof got) {
            return 0;
        }
        if (o != 0u) {
            got[o++] = ',';
        }
        if (st != QS_OK) {
            memcpy(got + o, "error", 5);
            o += 5;
            continue;
        }
        const uint32_t nums[2] = {fr.seq, fr.flags};
        for (int j = 0; j < 2; ++j) {
            char digits[8];
            int nd = 0;
            uint32_t v = nums[j];
            do {
                digits[nd++] = (char)('0' + v % 10u);
                v /= 10u;
            } while (v != 0u);
            while (nd > 0) {
                got[o++] = digits[--nd];
            }
            got[o++] = ':';
        }
        for (size_t b = 0; b < fr.len; ++b) {
            got[o++] = kHex[fr.payload[b] >> 4];
            got[o++] = kHex[fr.payload[b] & 15u];
        }
    }
    return o == want->value_len && memcmp(got, want->value, o) == 0;
}

/* StepOrder travels only on the MQTT fleet topic (SPEC 6.9): a board never decodes one
 * and refuses it as an unknown type, which is what its vector checks here. */
#define FLEET_ONLY_TYPE 0x4Au

static int case_msg(const vcase *c)
{
    static char text[CASE_BYTES_MAX];
    size_t n, nout;
    uint64_t listed_type;
    if (!value_hex(get(c, "hex"), g_bytes_a, sizeof g_bytes_a, &n)) {
        return 0;
    }
    if (value_u64(c, "type_code", &listed_type) && listed_type == FLEET_ONLY_TYPE) {
        qs_decode_error why = QS_DEC_OK;
        return qs_decode(g_bytes_a, n, &g_msg, &why, NULL) != QS_OK && why == QS_DEC_UNKNOWN_TYPE;
    }
    if (qs_decode(g_bytes_a, n, &g_msg, NULL, NULL) != QS_OK) {
        return 0;
    }
    for (uint32_t i = 0; i < c->n; ++i) {
        const case_field *f = &c->fields[i];
        char name[32];
        if (f->name_len >= sizeof name) {
            return 0;
        }
        memcpy(name, f->name, f->name_len);
        name[f->name_len] = '\0';
        if (strcmp(name, "hex") == 0) {
            continue;
        }
        if (strcmp(name, "type") == 0) {
            const char *t = qs_msg_type_name(g_msg.type);
            if (t == NULL || strlen(t) != f->value_len || memcmp(t, f->value, f->value_len) != 0) {
                return 0;
            }
            continue;
        }
        if (strcmp(name, "type_code") == 0) {
            uint64_t code;
            if (!value_u64(c, "type_code", &code) || code != g_msg.type) {
                return 0;
            }
            continue;
        }
        if (!qs_msg_field_text(&g_msg, name, text, sizeof text) || strlen(text) != f->value_len ||
            memcmp(text, f->value, f->value_len) != 0) {
            return 0;
        }
    }
    return qs_encode(&g_msg, g_bytes_b, sizeof g_bytes_b, &nout) == QS_OK && nout == n &&
           memcmp(g_bytes_a, g_bytes_b, n) == 0;
}

static int case_bad(const vcase *c)
{
    size_t n;
    qs_decode_error err;
    const case_field *want = get(c, "error");
    if (want == NULL || !value_hex(get(c, "hex"), g_bytes_a, sizeof g_bytes_a, &n) ||
        qs_decode(g_bytes_a, n, &g_msg, &err, NULL) == QS_OK) {
        return 0;
    }
    const char *name = qs_decode_error_name(err);
    return strlen(name) == want->value_len && memcmp(name, want->value, want->value_len) == 0;
}

static int case_update_f32(const vcase *c) { return case_update(c, 0); }
static int case_update_i8(const vcase *c) { return case_update(c, 1); }

typedef struct {
    const char *group;
    int (*run)(const vcase *c);
} group_entry;

static const group_entry kGroups[] = {
    {"philox", case_philox}, {"rademacher", case_rademacher}, {"batch", case_batch},
    {"fp32", case_update_f32}, {"int8_fp16", case_update_i8}, {"frame", case_frame},
    {"stream", case_stream}, {"msg", case_msg}, {"bad", case_bad},
};

typedef struct {
    const char *name;
    int (*run)(fields *f);
} kind_entry;

static const kind_entry kKinds[] = {
    {"log2", run_log2},
    {"table", run_table},
    {"loss", run_loss},
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

/* Run the completed case c; counts it under its group. Returns 1 if it passed. */
static int flush_case(vcase *c, qs_vector_report *report)
{
    if (c->n == 0u) {
        return 1;
    }
    int ok = 0;
    int known = 0;
    char group[QS_VECTOR_KIND_LEN];
    const size_t glen = c->group_len < sizeof group - 1u ? c->group_len : sizeof group - 1u;
    memcpy(group, c->prefix, glen);
    group[glen] = '\0';
    for (size_t i = 0; i < sizeof kGroups / sizeof kGroups[0]; ++i) {
        if (strcmp(kGroups[i].group, group) == 0) {
            known = 1;
            ok = !c->overflow && kGroups[i].run(c);
            qs_vector_kind_count *k = count_for(report, kGroups[i].group);
            if (k != NULL) {
                ok ? ++k->passed : ++k->failed;
            }
        }
    }
    if (!known) {
        ++report->skipped;
        ok = 1;
    }
    c->n = 0;
    c->overflow = 0;
    return ok;
}

/* Is this line "<group>.<case>.<field> <value>"? Adds it to the current case, flushing
 * the previous case when the prefix changes. Returns -1 if not such a line, else the
 * result of a flush (1 = nothing failed). */
static int case_line(vcase *c, const char *line, size_t len, qs_vector_report *report)
{
    size_t key_end = 0;
    while (key_end < len && line[key_end] != ' ') {
        ++key_end;
    }
    size_t last_dot = key_end;
    while (last_dot > 0 && line[last_dot - 1] != '.') {
        --last_dot;
    }
    if (line[0] == '#' || last_dot == 0) {
        return -1;
    }
    const size_t prefix_len = last_dot - 1;
    int ok = 1;
    if (c->n != 0u && (c->prefix_len != prefix_len || memcmp(c->prefix, line, prefix_len) != 0)) {
        ok = flush_case(c, report);
    }
    if (c->n == 0u) {
        c->prefix = line;
        c->prefix_len = prefix_len;
        c->group_len = 0;
        while (c->group_len < prefix_len && line[c->group_len] != '.') {
            ++c->group_len;
        }
    }
    if (c->n == CASE_FIELDS_MAX) {
        c->overflow = 1;
        return ok;
    }
    case_field *f = &c->fields[c->n++];
    f->name = line + last_dot;
    f->name_len = key_end - last_dot;
    f->value = key_end < len ? line + key_end + 1 : line + len;
    f->value_len = key_end < len ? len - key_end - 1 : 0;
    while (f->value_len > 0 && f->value[f->value_len - 1] == '\r') {
        --f->value_len;
    }
    return ok;
}

static void note_failure(qs_vector_report *report, uint32_t line_no, uint32_t *failures)
{
    ++*failures;
    if (report->first_failed == 0u) {
        report->first_failed = line_no;
    }
}

uint32_t qs_vectors_run(const char *text, size_t len, qs_vector_report *report, qs_vector_fail_fn on_fail)
{
    static vcase current;
    memset(report, 0, sizeof *report);
    memset(&current, 0, sizeof current);
    g_table.valid = 0;
    uint32_t failures = 0;
    uint32_t line_no = 0;
    uint32_t case_line_no = 0;
    size_t pos = 0;
    while (pos < len) {
        size_t end = pos;
        while (end < len && text[end] != '\n') {
            ++end;
        }
        ++line_no;
        const uint32_t was_empty = current.n == 0u;
        const int r = end > pos ? case_line(&current, text + pos, end - pos, report) : -1;
        if (r == 0) {
            note_failure(report, case_line_no, &failures);
            if (on_fail != NULL) {
                on_fail(case_line_no, current.prefix, current.prefix_len);
            }
        }
        if (r >= 0 && (was_empty || current.n == 1u)) {
            case_line_no = line_no;
        }
        if (r < 0) {
            fields f = {text + pos, text + end};
            if (!run_line(&f, report)) {
                note_failure(report, line_no, &failures);
                if (on_fail != NULL) {
                    on_fail(line_no, text + pos, end - pos);
                }
            }
        }
        pos = end + 1;
    }
    const char *prefix = current.prefix;
    const size_t prefix_len = current.prefix_len;
    if (!flush_case(&current, report)) {
        note_failure(report, case_line_no, &failures);
        if (on_fail != NULL) {
            on_fail(case_line_no, prefix, prefix_len);
        }
    }
    return failures;
}
