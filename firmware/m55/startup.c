/*
 * Reset and exception vectors for the Cortex-M55 on QEMU's mps3-an547: enable the FPU
 * before any float code, copy .data, clear .bss, run main. No C library start-up.
 */
#include <stdint.h>
#include <string.h>

#include "an547.h"

extern uint32_t __data_start, __data_end, __data_load, __bss_start, __bss_end, __stack_top;
extern uint32_t __sram_bss_start, __sram_bss_end, __ddr_bss_start, __ddr_bss_end;

int main(void);
void qs_reset_handler(void);
void qs_default_handler(void);
void qs_systick_handler(void);

__attribute__((noreturn)) void qs_reset_handler(void)
{
    /* CP10/CP11 full access: the FPU (and MVE) are usable only after this. */
    SCB_CPACR |= (0xFu << 20);
    __asm__ volatile("dsb\n\tisb" ::: "memory");
    /* IEEE semantics the update arithmetic relies on: round to nearest even, subnormals
     * kept (FZ = 0), NaNs propagated (DN = 0), IEEE half precision (AHP = 0) — in FPSCR
     * and in FPDSCR, its default for exception handlers. */
    const uint32_t ieee_mask = (0x3u << 22) | (1u << 24) | (1u << 25) | (1u << 26);
    uint32_t fpscr;
    __asm__ volatile("vmrs %0, fpscr" : "=r"(fpscr));
    fpscr &= ~ieee_mask;
    __asm__ volatile("vmsr fpscr, %0" : : "r"(fpscr));
    SCB_FPDSCR &= ~ieee_mask;
    memcpy(&__data_start, &__data_load, (size_t)((char *)&__data_end - (char *)&__data_start));
    memset(&__bss_start, 0, (size_t)((char *)&__bss_end - (char *)&__bss_start));
    memset(&__sram_bss_start, 0, (size_t)((char *)&__sram_bss_end - (char *)&__sram_bss_start));
    memset(&__ddr_bss_start, 0, (size_t)((char *)&__ddr_bss_end - (char *)&__ddr_bss_start));
    (void)main();
    for (;;) {
        __asm__ volatile("wfi");
    }
}

__attribute__((noreturn)) void qs_default_handler(void)
{
    for (;;) {
        __asm__ volatile("bkpt #0");
    }
}

/* 16 system exceptions; external interrupts are not used (the UART is polled). */
__attribute__((section(".vectors"), used)) static void (*const kVectors[16])(void) = {
    (void (*)(void))(uintptr_t)&__stack_top,
    qs_reset_handler,
    qs_default_handler, /* NMI */
    qs_default_handler, /* HardFault */
    qs_default_handler, /* MemManage */
    qs_default_handler, /* BusFault */
    qs_default_handler, /* UsageFault */
    qs_default_handler, /* SecureFault */
    0, 0, 0,
    qs_default_handler, /* SVCall */
    qs_default_handler, /* DebugMonitor */
    0,
    qs_default_handler, /* PendSV */
    qs_systick_handler,
};
