/* Port layer for QEMU's mps3-an547: CMSDK UART0 polled, SysTick clock, SRAM/DDR model memory. */
#include <string.h>

#include "an547.h"
#include "codec.h"
#include "port.h"

/* The model region: the first 8 MiB of DDR (an547.ld), plenty for the default models. */
#define AN547_MODEL_REGION_BYTES ((8u << 20) - 64u)

__attribute__((section(".ddr_bss"), aligned(16))) static uint8_t g_model_region[AN547_MODEL_REGION_BYTES];

/* SysTick counts down from SYSTICK_RELOAD at the CPU clock; an interrupt each wrap. */
#define SYSTICK_RELOAD (AN547_SYSCLK_HZ / 1000u - 1u) /* one millisecond */
static volatile uint64_t g_ms;

void qs_systick_handler(void);
void qs_systick_handler(void)
{
    ++g_ms;
}

qs_status qs_port_init(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    AN547_UART_BAUDDIV = 16u; /* QEMU ignores the rate but refuses divisors below 16 */
    AN547_UART_CTRL = AN547_UART_CTRL_TXEN | AN547_UART_CTRL_RXEN;
    SYST_RVR = SYSTICK_RELOAD;
    SYST_CVR = 0u;
    SYST_CSR = 0x7u; /* processor clock, interrupt, enable */
    return QS_OK;
}

void qs_port_info_get(qs_port_info *info)
{
    info->board_id = "qemu-an547";
    info->firmware = "qsched-fw-m55/0.1";
    info->npu = QS_NPU_NONE;
    info->ram_kib = (512u + 512u + 2048u + 8192u); /* ITCM + DTCM + SRAM + model DDR */
}

extern const uint8_t __dataset_base[];
extern const uint8_t __dataset_limit[];

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

const uint8_t *qs_port_dataset(size_t *len)
{
    /* The blob's length follows from its header; qs_dataset_parse checks the rest. */
    const uint8_t *b = __dataset_base;
    *len = 0;
    if (b[0] != 'Q' || b[1] != 'Z' || b[2] != 'D' || b[3] != 'S') {
        return NULL;
    }
    const uint64_t sample = le32(b + 16), n_train = le32(b + 8), n_val = le32(b + 12);
    const uint64_t pad = 3u;
    const uint64_t total = 72u + ((n_train * sample + pad) & ~pad) + ((n_train + pad) & ~pad) +
                           ((n_val * sample + pad) & ~pad) + ((n_val + pad) & ~pad);
    if (total > (uint64_t)(uintptr_t)__dataset_limit) {
        return NULL;
    }
    *len = (size_t)total;
    return b;
}

uint32_t qs_port_entropy(void)
{
    /* Boot is deterministic under QEMU; the SysTick phase at the first call is the best
     * there is. SYN on the first frame keeps a repeated sequence number harmless. */
    return SYST_CVR ^ (uint32_t)g_ms;
}

qs_status qs_port_serial_write(const uint8_t *data, size_t len)
{
    for (size_t i = 0; i < len; ++i) {
        while (AN547_UART_STATE & AN547_UART_STATE_TXFULL) {
        }
        AN547_UART_DATA = data[i];
    }
    return QS_OK;
}

uint64_t qs_port_now_us(void)
{
    uint64_t ms;
    uint32_t val;
    do { /* re-read if the millisecond interrupt hit in between */
        ms = g_ms;
        val = SYST_CVR;
    } while (ms != g_ms);
    return ms * 1000u + (uint64_t)(SYSTICK_RELOAD - val) / (AN547_SYSCLK_HZ / 1000000u);
}

qs_status qs_port_serial_read(uint8_t *buf, size_t cap, size_t *got, uint32_t timeout_us)
{
    *got = 0;
    const uint64_t start = qs_port_now_us();
    while (*got < cap) {
        if (AN547_UART_STATE & AN547_UART_STATE_RXFULL) {
            buf[(*got)++] = (uint8_t)AN547_UART_DATA;
            continue;
        }
        /* Return what arrived as soon as the line goes quiet. */
        if (*got > 0u || qs_port_now_us() - start >= timeout_us) {
            break;
        }
    }
    return QS_OK;
}

qs_status qs_port_npu_forward(const qs_model *model, const int8_t *input, const int8_t *flat,
                              const int8_t **logits)
{
    (void)model;
    (void)input;
    (void)flat;
    (void)logits;
    return QS_ERR_UNSUPPORTED; /* no NPU: the CPU reference kernels run */
}

void *qs_port_model_region(size_t *size)
{
    *size = sizeof g_model_region;
    return g_model_region;
}

void qs_port_log(const char *text)
{
    (void)text; /* UART0 carries the protocol; nothing else may be written to it */
}

#ifndef NDEBUG
void qs_assert_failed(const char *file, int line, const char *cond)
{
    (void)file;
    (void)line;
    (void)cond;
    __asm__ volatile("bkpt #1");
    for (;;) {
    }
}
#endif
