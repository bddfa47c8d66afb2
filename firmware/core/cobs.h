/* Consistent Overhead Byte Stuffing: frames on the serial link are COBS + a 0x00 delimiter. */
#ifndef QS_COBS_H
#define QS_COBS_H

#include <stddef.h>
#include <stdint.h>

#include "qs_status.h"

/* Worst-case encoded size of n bytes (one code byte per 254 data bytes, plus one). */
#define QS_COBS_MAX_ENCODED(n) ((n) + (n) / 254u + 1u)

/*
 * Encode src (len bytes) into dst (capacity cap), without the trailing delimiter.
 * Returns QS_ERR_TOO_LARGE if cap < QS_COBS_MAX_ENCODED(len) might be exceeded.
 */
qs_status qs_cobs_encode(const uint8_t *src, size_t len, uint8_t *dst, size_t cap, size_t *out_len);

/*
 * Decode one frame (the bytes between delimiters, untrusted) into dst. Returns
 * QS_ERR_FORMAT on a zero byte or a code that runs past the end, QS_ERR_TOO_LARGE if
 * the result does not fit cap. dst may equal src (decoding never grows data).
 */
qs_status qs_cobs_decode(const uint8_t *src, size_t len, uint8_t *dst, size_t cap, size_t *out_len);

#endif
