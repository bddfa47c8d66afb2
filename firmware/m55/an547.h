/* The few MPS3 AN547 (Corstone SSE-300, Cortex-M55) registers the firmware touches. */
#ifndef QS_AN547_H
#define QS_AN547_H

#include <stdint.h>

#define AN547_REG(addr) (*(volatile uint32_t *)(addr))

/* UART0: CMSDK APB UART (QEMU hw/arm/mps2-tz.c, apb_ppcexp2 "uart0"). */
#define AN547_UART0_BASE 0x49303000u
#define AN547_UART_DATA AN547_REG(AN547_UART0_BASE + 0x00u)
#define AN547_UART_STATE AN547_REG(AN547_UART0_BASE + 0x04u)
#define AN547_UART_CTRL AN547_REG(AN547_UART0_BASE + 0x08u)
#define AN547_UART_BAUDDIV AN547_REG(AN547_UART0_BASE + 0x10u)
#define AN547_UART_STATE_TXFULL (1u << 0)
#define AN547_UART_STATE_RXFULL (1u << 1)
#define AN547_UART_CTRL_TXEN (1u << 0)
#define AN547_UART_CTRL_RXEN (1u << 1)

/* The system clock QEMU models for the AN547 FPGA image. */
#define AN547_SYSCLK_HZ 32000000u

/* Cortex-M system control: CPACR (FPU/MVE access), SysTick. */
#define SCB_CPACR AN547_REG(0xE000ED88u)
#define SCB_FPDSCR AN547_REG(0xE000EF3Cu)
#define SYST_CSR AN547_REG(0xE000E010u)
#define SYST_RVR AN547_REG(0xE000E014u)
#define SYST_CVR AN547_REG(0xE000E018u)

#endif
