/*
 * The board-specific services the portable agent needs, behind one small interface.
 * Implementations: host/port_host.c (POSIX serial fd), m55/port_an547.c (QEMU
 * mps3-an547, CMSDK UART polling), stm32n6/port_stm32n6.c (STM32CubeN6 HAL, USART1
 * with DMA on the ST-LINK virtual COM port, ll_aton NPU runtime). Exactly one is
 * linked into an image.
 */
#ifndef QS_PORT_H
#define QS_PORT_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"
#include "qs_status.h"

/* Identity a board reports in its Hello. */
typedef struct {
    const char *board_id; /* [A-Za-z0-9_.-]{1,32} */
    const char *firmware; /* printable ASCII, at most 24 characters */
    uint8_t npu;          /* QS_NPU_NONE, QS_NPU_NEURAL_ART (codec.h) */
    uint32_t ram_kib;
} qs_port_info;

/* Bring up the serial link and the clock. argc/argv are the host's; boards pass 0/NULL. */
qs_status qs_port_init(int argc, char **argv);

/* Identity of this board. */
void qs_port_info_get(qs_port_info *info);

/* Queue len bytes for sending; returns when they are handed to the link (DMA started on
 * the N6). QS_ERR_IO when the link is gone. */
qs_status qs_port_serial_write(const uint8_t *data, size_t len);

/* Read at most cap bytes, waiting up to timeout_us for the first one. *got = 0 on a
 * timeout. QS_ERR_IO when the link is gone (a host read of no data: unplugged). */
qs_status qs_port_serial_read(uint8_t *buf, size_t cap, size_t *got, uint32_t timeout_us);

/* Monotonic microseconds since qs_port_init. */
uint64_t qs_port_now_us(void);

/*
 * Memory placement: the one region that holds the model (blob, weights, accumulation
 * buffer, activation arena). On the N6 this is the NPU-visible AXISRAM; on QEMU the
 * AN547 SRAM/DDR; on the host a static array. Returns its base and size.
 */
void *qs_port_model_region(size_t *size);

/*
 * The forward pass of one sample on the NPU (STM32N6: the Neural-ART network compiled
 * from the same model, run through ST's ll_aton runtime), trainable weights taken from
 * flat (num_params int8). On success *logits points at num_classes int8 values that
 * stay valid until the next call. QS_ERR_UNSUPPORTED when the board has no NPU or the
 * loaded blob is not the network compiled into the image: the agent then runs the
 * CPU reference kernels, which compute the same bits.
 */
qs_status qs_port_npu_forward(const qs_model *model, const int8_t *input, const int8_t *flat,
                              const int8_t **logits);

/* The data set blob this board holds ("QZDS", qsched.zo.blob), or NULL: a file on the
 * host, a blob QEMU loads into DDR, a flash region on the N6. */
const uint8_t *qs_port_dataset(size_t *len);

/* A few bits that differ between boots (the first frame's sequence number). */
uint32_t qs_port_entropy(void);

/* Diagnostic text for a human (host stderr, semihosting or nothing); may be a no-op. */
void qs_port_log(const char *text);

#endif
