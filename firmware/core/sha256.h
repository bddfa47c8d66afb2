/* SHA-256 (FIPS 180-4): identifies the model blob a board holds (Hello.model_hash). */
#ifndef QS_SHA256_H
#define QS_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t state[8];
    uint64_t length; /* bytes hashed so far */
    uint8_t block[64];
    uint32_t used;
} qs_sha256;

void qs_sha256_init(qs_sha256 *h);
void qs_sha256_update(qs_sha256 *h, const void *data, size_t len);
void qs_sha256_final(qs_sha256 *h, uint8_t digest[32]);

/* The protocol's 64-bit identity of a byte string: SHA-256, first 8 bytes as LE u64. */
uint64_t qs_sha256_id(const void *data, size_t len);

#endif
