/*
 * Cortex-M55 self-test image: runs the protocol's test vectors (linked in by
 * vector_blob.S) and a determinism digest on the emulated CPU, prints one line on
 * UART0 and exits QEMU through semihosting:
 *
 *   QS-SELFTEST PASS <kind>=<passed>/<failed> ... digest=<crc hex> acc8=<crc hex> batch=<crc hex>
 *   QS-SELFTEST FAIL line=<n> ...
 *
 * digest and acc8 are the weight checksums after a fixed series of INT8 updates with the
 * FP16 and with the INT8 accumulation buffer (34 steps: two rescales); the test suite
 * computes the same series in Python, so the line proves the M55 computes the same bits
 * as the host.
 */
#include <stdint.h>
#include <string.h>

#include "crc32.h"
#include "port.h"
#include "prng.h"
#include "update.h"
#include "vectors.h"

extern const char qs_vector_text[];
extern const char qs_vector_text_end[];

#define DIGEST_WEIGHTS 1000u
#define DIGEST_STEPS 5u
#define DIGEST_PAIRS 8u
#define DIGEST_SEED 0x0123456789ABCDEFull

static void put(const char *s)
{
    qs_port_serial_write((const uint8_t *)s, strlen(s));
}

static void put_u32(uint32_t v, int hex)
{
    char buf[12];
    int n = 0;
    const uint32_t base = hex ? 16u : 10u;
    do {
        buf[n++] = "0123456789abcdef"[v % base];
        v /= base;
    } while (v != 0u);
    while (n > 0) {
        const char c[2] = {buf[--n], '\0'};
        put(c);
    }
}

static float f32_from_bits(uint32_t bits)
{
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* The update series the Python side replays (tests/test_firmware_m55.py). */
static uint32_t update_digest(void)
{
    static int8_t w[DIGEST_WEIGHTS];
    static uint16_t buf[DIGEST_WEIGHTS];
    for (uint32_t i = 0; i < DIGEST_WEIGHTS; ++i) {
        w[i] = (int8_t)((int32_t)((i * 37u) % 255u) - 127);
        buf[i] = 0;
    }
    for (uint32_t t = 0; t < DIGEST_STEPS; ++t) {
        qs_pair pairs[DIGEST_PAIRS];
        for (uint32_t k = 0; k < DIGEST_PAIRS; ++k) {
            pairs[k].k = 3u * k;
            pairs[k].c = f32_from_bits(0x3E000000u + k * 0x123457u + t * 0x7771u + ((k & 1u) << 31));
        }
        const qs_stream s = {DIGEST_SEED, t};
        if (qs_apply_int8_fp16(w, buf, DIGEST_WEIGHTS, 0, s, pairs, DIGEST_PAIRS, NULL) != QS_OK) {
            return 0;
        }
    }
    uint32_t crc = qs_crc32_update(0, w, DIGEST_WEIGHTS);
    return qs_crc32_fp16(crc, buf, DIGEST_WEIGHTS);
}

/* The same coefficients with the INT8 accumulator over three tensors, 34 steps: tiny
 * updates until step 15 (the shifts refine), large ones after (they coarsen again). */
#define ACC8_STEPS 34u
static uint32_t acc8_digest(void)
{
    static const uint32_t sizes[3] = {600u, 7u, 393u};
    static int8_t w[DIGEST_WEIGHTS];
    static int8_t buf[DIGEST_WEIGHTS];
    int8_t shifts[3] = {QS_ACC8_SHIFT_MIN, QS_ACC8_SHIFT_MIN, QS_ACC8_SHIFT_MIN};
    for (uint32_t i = 0; i < DIGEST_WEIGHTS; ++i) {
        w[i] = (int8_t)((int32_t)((i * 37u) % 255u) - 127);
        buf[i] = 0;
    }
    for (uint32_t t = 0; t < ACC8_STEPS; ++t) {
        qs_pair pairs[DIGEST_PAIRS];
        const uint32_t exponent = t < 16u ? 0x3A000000u : 0x40000000u; /* ~5e-4 or ~2 */
        for (uint32_t k = 0; k < DIGEST_PAIRS; ++k) {
            pairs[k].k = 3u * k;
            pairs[k].c = f32_from_bits(exponent + k * 0x12345u + t * 0x777u + ((k & 1u) << 31));
        }
        const qs_stream s = {DIGEST_SEED, t};
        if (qs_apply_int8_acc8(w, buf, shifts, sizes, 3u, s, pairs, DIGEST_PAIRS, NULL) != QS_OK) {
            return 0;
        }
    }
    uint32_t crc = qs_crc32_update(0, w, DIGEST_WEIGHTS);
    crc = qs_crc32_update(crc, buf, DIGEST_WEIGHTS);
    return qs_crc32_update(crc, shifts, sizeof shifts);
}

static uint32_t batch_digest(void)
{
    uint32_t idx[64];
    uint8_t le[4];
    uint32_t crc = 0;
    if (qs_batch_indices(DIGEST_SEED, 3u, 64u, 1797u, idx) != QS_OK) {
        return 0;
    }
    for (uint32_t j = 0; j < 64u; ++j) {
        for (uint32_t b = 0; b < 4u; ++b) {
            le[b] = (uint8_t)(idx[j] >> (8u * b));
        }
        crc = qs_crc32_update(crc, le, 4);
    }
    return crc;
}

static void semihosting_exit(int code)
{
    /* SYS_EXIT with ADP_Stopped_ApplicationExit (0x20026); QEMU needs -semihosting. */
    register uint32_t r0 __asm__("r0") = 0x18u;
    register uint32_t r1 __asm__("r1") = code == 0 ? 0x20026u : 0x20024u;
    __asm__ volatile("bkpt #0xAB" : : "r"(r0), "r"(r1) : "memory");
}

int main(void)
{
    static qs_vector_report report;
    qs_port_init(0, NULL);
    const size_t len = (size_t)(qs_vector_text_end - qs_vector_text);
    const uint32_t failures = qs_vectors_run(qs_vector_text, len, &report, NULL);
    put(failures == 0u && report.nkinds > 0u ? "QS-SELFTEST PASS" : "QS-SELFTEST FAIL");
    if (failures != 0u) {
        put(" line=");
        put_u32(report.first_failed, 0);
    }
    for (uint32_t i = 0; i < report.nkinds; ++i) {
        put(" ");
        put(report.kinds[i].name);
        put("=");
        put_u32(report.kinds[i].passed, 0);
        put("/");
        put_u32(report.kinds[i].failed, 0);
    }
    put(" skipped=");
    put_u32(report.skipped, 0);
    put(" digest=");
    put_u32(update_digest(), 1);
    put(" acc8=");
    put_u32(acc8_digest(), 1);
    put(" batch=");
    put_u32(batch_digest(), 1);
    put("\r\n");
    semihosting_exit(failures == 0u ? 0 : 1);
    return 0;
}
