/*
 * Philox4x32-10 keyed by (job seed, step, k), as protocol/SPEC.md section 1.
 * Same streams as the Python reference (qsched.zo.prng); no floating point.
 */
#ifndef QS_PRNG_H
#define QS_PRNG_H

#include <stdint.h>

#include "qs_status.h"

#define QS_DOMAIN_PERTURB 0u
#define QS_DOMAIN_BATCH 1u
/* One Philox call yields 4 words = 128 sign bits = 128 parameters of z_k. */
#define QS_PERTURB_BLOCK 128u

/* Philox4x32-10 on one counter: out = philox(ctr, key). out may alias ctr. */
void qs_philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

/*
 * Sign bits of z_k for parameters [128*block, 128*block + 128): bit (i mod 32) of
 * word (i mod 128) div 32 is 1 where z = -1.
 */
void qs_perturb_bits(uint64_t seed, uint32_t step, uint32_t k, uint32_t block, uint32_t bits[4]);

/*
 * Minibatch sample indices (with replacement) of a step: out[j] for j < batch_size.
 * Returns QS_ERR_ARG if dataset_size is 0.
 */
qs_status qs_batch_indices(uint64_t seed, uint32_t step, uint32_t batch_size, uint32_t dataset_size,
                           uint32_t *out);

#endif
