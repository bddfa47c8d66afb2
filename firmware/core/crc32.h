/* CRC-32 (IEEE 802.3, reflected, zlib's crc32): the weight checksum and the frame check. */
#ifndef QS_CRC32_H
#define QS_CRC32_H

#include <stddef.h>
#include <stdint.h>

/*
 * Continue a CRC-32 over more bytes. Start with crc = 0 (as zlib's crc32(0, ...));
 * feeding a buffer in pieces gives the same value as feeding it at once.
 */
uint32_t qs_crc32_update(uint32_t crc, const void *data, size_t len);

#endif
