/*
 * Stand-in for ST's Neural-ART runtime header (ll_aton), for a compile check of
 * stm32n6/port_stm32n6.c only: the names the port uses, shaped as ll_aton declares
 * them. It is not the runtime and nothing built from it runs.
 */
#ifndef QS_STANDIN_LL_ATON_RUNTIME_H
#define QS_STANDIN_LL_ATON_RUNTIME_H

#include <stdint.h>

typedef struct {
    const char *name;
    uint8_t *addr_base;
    uint32_t offset_start;
    uint32_t offset_end;
} LL_Buffer_InfoTypeDef;

#define LL_Buffer_addr_start(buf) ((buf)->addr_base + (buf)->offset_start)
#define LL_Buffer_len(buf) ((buf)->offset_end - (buf)->offset_start)

typedef enum { LL_ATON_RT_NO_WFE = 0, LL_ATON_RT_WFE = 1, LL_ATON_RT_DONE = 2 } LL_ATON_RT_RetValues_t;

typedef struct {
    const char *name;
} NN_Instance_TypeDef;

#define LL_ATON_DECLARE_NAMED_NN_INSTANCE_AND_INTERFACE(nn)                  \
    const LL_Buffer_InfoTypeDef *LL_ATON_Input_Buffers_Info_##nn(void);     \
    const LL_Buffer_InfoTypeDef *LL_ATON_Output_Buffers_Info_##nn(void);    \
    static NN_Instance_TypeDef NN_Instance_##nn = {#nn}

void LL_ATON_RT_RuntimeInit(void);
void LL_ATON_RT_Init_Network(NN_Instance_TypeDef *instance);
void LL_ATON_RT_Reset_Network(NN_Instance_TypeDef *instance);
LL_ATON_RT_RetValues_t LL_ATON_RT_RunEpochBlock(NN_Instance_TypeDef *instance);
#define LL_ATON_OSAL_WFE() ((void)0)

#endif
