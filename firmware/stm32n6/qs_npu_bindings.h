/*
 * Where the compiled Neural-ART network keeps each trainable weight tensor (included by
 * port_stm32n6.c). Generate it for the exact model from the ST Edge AI compiler's
 * report, with the params memory pool placed in AXISRAM: one entry per trainable op,
 * in flat-vector order, {param_offset, count, address}. With no entries (as shipped)
 * the NPU is never used and the Cortex-M55 runs the reference kernels.
 */
#ifndef QS_NPU_BINDINGS_H
#define QS_NPU_BINDINGS_H

static const qs_npu_binding kNpuBindings[1] = {{0u, 0u, (int8_t *)0}};
static const uint32_t kNpuBindingCount = 0u;

#endif
