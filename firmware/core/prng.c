#include "prng.h"

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u
#define PHILOX_ROUNDS 10

void qs_philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4])
{
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < PHILOX_ROUNDS; ++round) {
        if (round != 0) {
            k0 += PHILOX_W0; /* uint32 wrap-around is the specified key schedule */
            k1 += PHILOX_W1;
        }
        const uint64_t p0 = (uint64_t)PHILOX_M0 * c0;
        const uint64_t p1 = (uint64_t)PHILOX_M1 * c2;
        c0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        c1 = (uint32_t)p1;
        c2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c3 = (uint32_t)p0;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

static void seed_key(uint64_t seed, uint32_t key[2])
{
    key[0] = (uint32_t)seed;
    key[1] = (uint32_t)(seed >> 32);
}

void qs_perturb_bits(uint64_t seed, uint32_t step, uint32_t k, uint32_t block, uint32_t bits[4])
{
    uint32_t key[2];
    const uint32_t ctr[4] = {block, step, k, QS_DOMAIN_PERTURB};
    seed_key(seed, key);
    qs_philox4x32(ctr, key, bits);
}

qs_status qs_batch_indices(uint64_t seed, uint32_t step, uint32_t batch_size, uint32_t dataset_size,
                           uint32_t *out)
{
    if (dataset_size == 0u) {
        return QS_ERR_ARG;
    }
    uint32_t key[2];
    uint32_t words[4];
    seed_key(seed, key);
    for (uint32_t j = 0; j < batch_size; ++j) {
        if ((j & 3u) == 0u) {
            const uint32_t ctr[4] = {j >> 2, step, 0u, QS_DOMAIN_BATCH};
            qs_philox4x32(ctr, key, words);
        }
        /* word < 2^32 and N < 2^32: the product fits uint64, the result is < N. */
        out[j] = (uint32_t)(((uint64_t)words[j & 3u] * dataset_size) >> 32);
    }
    return QS_OK;
}
