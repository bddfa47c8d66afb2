/*
 * Stand-in for the STM32CubeN6 HAL, for a compile check of stm32n6/port_stm32n6.c only:
 * the few names the port uses, declared with the HAL's and CMSIS's types. It is not
 * the HAL and nothing built from it runs; it lets the tests catch a port that no longer
 * matches core/port.h or the core's headers.
 */
#ifndef QS_STANDIN_STM32N6XX_HAL_H
#define QS_STANDIN_STM32N6XX_HAL_H

#include <stdint.h>

typedef enum { HAL_OK = 0, HAL_ERROR = 1, HAL_BUSY = 2, HAL_TIMEOUT = 3 } HAL_StatusTypeDef;
typedef enum { HAL_UART_STATE_RESET = 0x00, HAL_UART_STATE_READY = 0x20 } HAL_UART_StateTypeDef;

typedef struct {
    volatile uint32_t CBR1; /* block size: the DMA's remaining-bytes counter */
} DMA_Channel_TypeDef;

typedef struct {
    DMA_Channel_TypeDef *Instance;
} DMA_HandleTypeDef;

typedef struct {
    volatile HAL_UART_StateTypeDef gState;
    DMA_HandleTypeDef *hdmatx;
    DMA_HandleTypeDef *hdmarx;
} UART_HandleTypeDef;

#define __HAL_DMA_GET_COUNTER(h) ((h)->Instance->CBR1 & 0xFFFFu)

HAL_StatusTypeDef HAL_UART_Receive_DMA(UART_HandleTypeDef *huart, uint8_t *pData, uint16_t Size);
HAL_StatusTypeDef HAL_UART_Transmit_DMA(UART_HandleTypeDef *huart, const uint8_t *pData, uint16_t Size);
uint32_t HAL_GetUIDw0(void);

/* CMSIS core (core_cm55.h) */
extern uint32_t SystemCoreClock;
typedef struct {
    volatile uint32_t CTRL;
    volatile uint32_t CYCCNT;
} DWT_Type;
typedef struct {
    volatile uint32_t DEMCR;
} CoreDebug_Type;
#define DWT ((DWT_Type *)0xE0001000UL)
#define CoreDebug ((CoreDebug_Type *)0xE000EDF0UL)
#define DWT_CTRL_CYCCNTENA_Msk (1UL)
#define CoreDebug_DEMCR_TRCENA_Msk (1UL << 24)
void SCB_CleanDCache_by_Addr(volatile void *addr, int32_t dsize);
void SCB_InvalidateDCache_by_Addr(volatile void *addr, int32_t dsize);
#define __WFI() ((void)0)
#define __BKPT(value) ((void)(value))

#endif
