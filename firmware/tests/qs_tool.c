/*
 * Host test driver: reads commands from stdin, one per line, and answers each with one
 * line on stdout, so pytest can compare the C core with the Python reference on many
 * cases in one process. Numbers are decimal unless noted; arrays are hex bytes.
 *
 *   vectors <path>                                  -> "ok <kind>=<pass>/<fail> ..." or "fail <line> ..."
 *   philox <c0> <c1> <c2> <c3> <k0> <k1>            -> 4 hex words
 *   batch <seed> <step> <B> <N>                     -> B indices
 *   f16 <f32 bits hex>                              -> f16 bits hex
 *   f32 <f16 bits hex>                              -> f32 bits hex
 *   crc32 <hex>                                     -> crc hex
 *   cobs_enc <hex> / cobs_dec <hex>                 -> hex, or "err <status>"
 *   perturb_i8 <seed> <step> <k> <eps> <sign> <first> <w hex>       -> hex
 *   perturb_f32 <seed> <step> <k> <eps bits> <sign> <first> <hex>   -> hex
 *   apply_f32 <seed> <step> <first> <n> (<k> <c bits>)*n <theta hex> -> hex
 *   apply_i8 <seed> <step> <first> <n> (<k> <c bits>)*n <w hex> <buf hex> -> "<w hex> <buf hex>"
 *   apply_acc8 <seed> <step> <T> <size>*T <n> (<k> <c bits>)*n <w hex> <state hex> -> "<w hex> <state hex>"
 *   recal <C> <minor> <mult>*C <shift>*C <w hex> <buf hex> <exps hex> -> "<w hex> <buf hex> <exps hex>"
 *   ilog2 <v>                                       -> decimal
 *   forward <blob path> <inputs hex>                -> logits hex (samples back to back)
 *   budget <blob path>                              -> "<blob bytes> <params> <arena bytes>"
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cobs.h"
#include "codec.h"
#include "crc32.h"
#include "fp16.h"
#include "loss.h"
#include "model.h"
#include "prng.h"
#include "update.h"
#include "vectors.h"

#define TOOL_LINE_MAX (8u << 20)
#define TOOL_BYTES_MAX (2u << 20)
#define TOOL_PAIRS_MAX 4096u

#ifndef NDEBUG
void qs_assert_failed(const char *file, int line, const char *cond)
{
    fprintf(stderr, "assertion failed: %s:%d: %s\n", file, line, cond);
    abort();
}
#endif

static char g_line[TOOL_LINE_MAX];
static uint8_t g_a[TOOL_BYTES_MAX], g_b[TOOL_BYTES_MAX], g_c[TOOL_BYTES_MAX + TOOL_BYTES_MAX / 254u + 1u];
static qs_pair g_pairs[TOOL_PAIRS_MAX];

static char *tok(void)
{
    return strtok(NULL, " \t\r\n");
}

static uint64_t num(int base)
{
    const char *t = tok();
    if (t == NULL) {
        fprintf(stderr, "missing argument\n");
        exit(2);
    }
    return strtoull(t, NULL, base);
}

static size_t hex_in(uint8_t *out, size_t cap)
{
    const char *t = tok();
    if (t == NULL) {
        fprintf(stderr, "missing hex argument\n");
        exit(2);
    }
    if (strcmp(t, "-") == 0) {
        return 0;
    }
    const size_t n = strlen(t) / 2u;
    if (n > cap) {
        fprintf(stderr, "hex argument too long\n");
        exit(2);
    }
    for (size_t i = 0; i < n; ++i) {
        unsigned v;
        sscanf(t + 2 * i, "%2x", &v);
        out[i] = (uint8_t)v;
    }
    return n;
}

static void hex_out(const void *data, size_t n)
{
    const uint8_t *p = (const uint8_t *)data;
    if (n == 0) {
        fputc('-', stdout);
    }
    for (size_t i = 0; i < n; ++i) {
        printf("%02x", p[i]);
    }
}

static float f32_of(uint32_t bits)
{
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static uint32_t bits_of(float v)
{
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    return b;
}

static void on_fail(uint32_t line, const char *text, size_t len)
{
    fprintf(stderr, "vector line %u failed: %.*s\n", (unsigned)line, (int)(len > 200 ? 200 : len), text);
}

static void cmd_vectors(void)
{
    const char *path = tok();
    FILE *fp = path ? fopen(path, "rb") : NULL;
    if (fp == NULL) {
        printf("err cannot open %s: %s\n", path ? path : "?", strerror(errno));
        return;
    }
    const size_t n = fread(g_c, 1, sizeof g_c, fp);
    fclose(fp);
    qs_vector_report rep;
    const uint32_t failures = qs_vectors_run((const char *)g_c, n, &rep, on_fail);
    printf("%s", failures ? "fail" : "ok");
    for (uint32_t i = 0; i < rep.nkinds; ++i) {
        printf(" %s=%u/%u", rep.kinds[i].name, (unsigned)rep.kinds[i].passed, (unsigned)rep.kinds[i].failed);
    }
    printf(" skipped=%u\n", (unsigned)rep.skipped);
}

static uint32_t read_pairs(void)
{
    const uint32_t n = (uint32_t)num(10);
    if (n > TOOL_PAIRS_MAX) {
        fprintf(stderr, "too many pairs\n");
        exit(2);
    }
    for (uint32_t p = 0; p < n; ++p) {
        g_pairs[p].k = (uint32_t)num(10);
        g_pairs[p].c = f32_of((uint32_t)num(16));
    }
    return n;
}

static void cmd_perturb(int is_f32)
{
    qs_stream s;
    s.seed = num(10);
    s.step = (uint32_t)num(10);
    const uint32_t k = (uint32_t)num(10);
    const uint64_t eps = num(is_f32 ? 16 : 10);
    const int32_t sign = (int32_t)strtol(tok(), NULL, 10);
    const uint32_t first = (uint32_t)num(10);
    const size_t n = hex_in(g_a, sizeof g_a);
    qs_status st;
    if (is_f32) {
        st = qs_perturb_f32((const float *)(void *)g_a, (float *)(void *)g_b, (uint32_t)(n / 4u), first, s, k,
                            f32_of((uint32_t)eps), sign);
    } else {
        st = qs_perturb_int8((const int8_t *)g_a, (int8_t *)g_b, (uint32_t)n, first, s, k, (int32_t)eps, sign);
    }
    if (st != QS_OK) {
        printf("err %s\n", qs_status_name(st));
        return;
    }
    hex_out(g_b, n);
    putchar('\n');
}

static void cmd_apply(int is_f32)
{
    qs_stream s;
    s.seed = num(10);
    s.step = (uint32_t)num(10);
    const uint32_t first = (uint32_t)num(10);
    const uint32_t npairs = read_pairs();
    const size_t n = hex_in(g_a, sizeof g_a);
    qs_status st;
    if (is_f32) {
        st = qs_apply_f32((float *)(void *)g_a, (uint32_t)(n / 4u), first, s, g_pairs, npairs);
    } else {
        const size_t nb = hex_in(g_b, sizeof g_b);
        if (nb != 2u * n) {
            printf("err buffer size\n");
            return;
        }
        st = qs_apply_int8_fp16((int8_t *)g_a, (uint16_t *)(void *)g_b, (uint32_t)n, first, s, g_pairs, npairs, NULL);
    }
    if (st != QS_OK) {
        printf("err %s\n", qs_status_name(st));
        return;
    }
    hex_out(g_a, n);
    if (!is_f32) {
        putchar(' ');
        hex_out(g_b, 2u * n);
    }
    putchar('\n');
}

/* INT8 accumulation buffer: state = n buffer bytes then T shifts. */
static void cmd_apply_acc8(void)
{
    static uint32_t sizes[256];
    qs_stream s;
    s.seed = num(10);
    s.step = (uint32_t)num(10);
    const uint32_t nt = (uint32_t)num(10);
    if (nt > 256u) {
        printf("err too many tensors\n");
        return;
    }
    uint64_t n = 0;
    for (uint32_t t = 0; t < nt; ++t) {
        sizes[t] = (uint32_t)num(10);
        n += sizes[t];
    }
    const uint32_t npairs = read_pairs();
    const size_t nw = hex_in(g_a, sizeof g_a);
    const size_t ns = hex_in(g_b, sizeof g_b);
    if (nw != n || ns != n + nt) {
        printf("err sizes\n");
        return;
    }
    const qs_status st = qs_apply_int8_acc8((int8_t *)g_a, (int8_t *)g_b, (int8_t *)g_b + n, sizes, nt, s, g_pairs,
                                            npairs, NULL);
    if (st != QS_OK) {
        printf("err %s\n", qs_status_name(st));
        return;
    }
    hex_out(g_a, nw);
    putchar(' ');
    hex_out(g_b, ns);
    putchar('\n');
}

/* Scale recalibration of one tensor of C channels (SPEC "Scale recalibration"). */
static void cmd_recal(void)
{
    static int32_t mult[4096], shift[4096];
    static int8_t exps[4096];
    const uint32_t channels = (uint32_t)num(10);
    const int minor = (int)num(10);
    if (channels == 0u || channels > 4096u) {
        printf("err channels\n");
        return;
    }
    for (uint32_t c = 0; c < channels; ++c) {
        mult[c] = (int32_t)num(10);
    }
    for (uint32_t c = 0; c < channels; ++c) {
        shift[c] = (int32_t)strtol(tok(), NULL, 10);
    }
    const size_t nw = hex_in(g_a, sizeof g_a);
    const size_t nb = hex_in(g_b, sizeof g_b);
    const size_t ne = hex_in((uint8_t *)exps, sizeof exps);
    if (nb != 2u * nw || ne != channels) {
        printf("err sizes\n");
        return;
    }
    (void)qs_recalibrate_fp16((int8_t *)g_a, (uint16_t *)(void *)g_b, (uint32_t)nw, channels, minor, exps, mult,
                              shift);
    hex_out(g_a, nw);
    putchar(' ');
    hex_out(g_b, nb);
    putchar(' ');
    hex_out(exps, ne);
    putchar('\n');
}

static void cmd_cobs(int encode)
{
    const size_t n = hex_in(g_a, sizeof g_a);
    size_t out;
    const qs_status st = encode ? qs_cobs_encode(g_a, n, g_c, sizeof g_c, &out)
                                : qs_cobs_decode(g_a, n, g_c, sizeof g_c, &out);
    if (st != QS_OK) {
        printf("err %s\n", qs_status_name(st));
        return;
    }
    hex_out(g_c, out);
    putchar('\n');
}

static qs_model g_model;

/* Load and prepare the model blob named by the next argument; 0 (answered) on failure. */
static int load_model(void)
{
    static int8_t scratch[TOOL_BYTES_MAX] __attribute__((aligned(16)));
    static uint32_t blob_words[TOOL_BYTES_MAX / 4u]; /* 4-aligned: int32 arrays read in place */
    const char *path = tok();
    FILE *fp = path ? fopen(path, "rb") : NULL;
    if (fp == NULL) {
        printf("err cannot open blob\n");
        return 0;
    }
    const size_t len = fread(blob_words, 1, sizeof blob_words, fp);
    fclose(fp);
    const qs_status st = qs_model_prepare(&g_model, (uint8_t *)blob_words, len, scratch, sizeof scratch);
    if (st != QS_OK) {
        printf("err %s\n", qs_status_name(st));
        return 0;
    }
    return 1;
}

/* Load a model blob from a file and run samples through it. */
static void cmd_forward(void)
{
    if (!load_model()) {
        return;
    }
    const size_t n = hex_in(g_a, sizeof g_a);
    const uint32_t sample = g_model.tensors[g_model.input].size;
    for (size_t off = 0; off + sample <= n; off += sample) {
        hex_out(qs_model_forward(&g_model, (const int8_t *)g_a + off, NULL), g_model.num_classes);
    }
    putchar('\n');
}

static void cmd_budget(void)
{
    if (load_model()) {
        printf("%zu %u %zu\n", g_model.blob_len, (unsigned)g_model.num_params, g_model.arena_size);
    }
}

static void dispatch(const char *cmd)
{
    if (strcmp(cmd, "vectors") == 0) {
        cmd_vectors();
    } else if (strcmp(cmd, "philox") == 0) {
        uint32_t in[6], out[4];
        for (int i = 0; i < 6; ++i) {
            in[i] = (uint32_t)num(10);
        }
        qs_philox4x32(in, in + 4, out);
        printf("%08x %08x %08x %08x\n", out[0], out[1], out[2], out[3]);
    } else if (strcmp(cmd, "batch") == 0) {
        const uint64_t seed = num(10);
        const uint32_t step = (uint32_t)num(10), b = (uint32_t)num(10), n = (uint32_t)num(10);
        uint32_t *idx = (uint32_t *)(void *)g_a;
        if (b > sizeof g_a / 4u || qs_batch_indices(seed, step, b, n, idx) != QS_OK) {
            printf("err bad-argument\n");
            return;
        }
        for (uint32_t j = 0; j < b; ++j) {
            printf(j ? " %u" : "%u", (unsigned)idx[j]);
        }
        putchar('\n');
    } else if (strcmp(cmd, "f16") == 0) {
        printf("%04x\n", qs_f16_from_f32(f32_of((uint32_t)num(16))));
    } else if (strcmp(cmd, "f32") == 0) {
        printf("%08x\n", bits_of(qs_f16_to_f32((uint16_t)num(16))));
    } else if (strcmp(cmd, "decode") == 0) {
        /* decode HEX: the decoder's verdict on a message (SPEC 6.4), as its kind name */
        const size_t n = hex_in(g_a, sizeof g_a);
        static qs_msg msg;
        qs_decode_error err = QS_DEC_OK;
        (void)qs_decode(g_a, n, &msg, &err, NULL);
        printf("%s\n", qs_decode_error_name(err));
    } else if (strcmp(cmd, "crc32") == 0) {
        const size_t n = hex_in(g_a, sizeof g_a);
        printf("%08x\n", qs_crc32_update(0, g_a, n));
    } else if (strcmp(cmd, "cobs_enc") == 0 || strcmp(cmd, "cobs_dec") == 0) {
        cmd_cobs(cmd[5] == 'e');
    } else if (strcmp(cmd, "perturb_i8") == 0 || strcmp(cmd, "perturb_f32") == 0) {
        cmd_perturb(cmd[8] == 'f');
    } else if (strcmp(cmd, "apply_f32") == 0 || strcmp(cmd, "apply_i8") == 0) {
        cmd_apply(cmd[6] == 'f');
    } else if (strcmp(cmd, "apply_acc8") == 0) {
        cmd_apply_acc8();
    } else if (strcmp(cmd, "recal") == 0) {
        cmd_recal();
    } else if (strcmp(cmd, "forward") == 0) {
        cmd_forward();
    } else if (strcmp(cmd, "budget") == 0) {
        cmd_budget();
    } else if (strcmp(cmd, "ilog2") == 0) {
        printf("%" PRIu64 "\n", qs_ilog2_q24(num(10)));
    } else {
        printf("err unknown command %s\n", cmd);
    }
}

int main(void)
{
    while (fgets(g_line, sizeof g_line, stdin) != NULL) {
        const char *cmd = strtok(g_line, " \t\r\n");
        if (cmd != NULL) {
            dispatch(cmd);
        }
        fflush(stdout);
    }
    return 0;
}
