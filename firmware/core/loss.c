#include "loss.h"

#define NORM_BITS 30u

qs_status qs_loss_check(const qs_loss_params *params)
{
    if (params->exp_table[0] != (1u << QS_LOSS_TABLE_BITS) || params->scale_q24 >= (1u << 28)) {
        return QS_ERR_ARG;
    }
    for (uint32_t d = 1; d < QS_LOSS_TABLE_SIZE; ++d) {
        if (params->exp_table[d] > params->exp_table[d - 1]) {
            return QS_ERR_ARG;
        }
    }
    return QS_OK;
}

uint64_t qs_ilog2_q24(uint64_t v)
{
    QS_ASSERT(v != 0u && v < (1ull << 62));
    uint32_t n = 0;
    for (uint64_t probe = v; probe >= 2u; probe >>= 1) {
        ++n;
    }
    /* Normalise to x in [2^30, 2^31): a left shift is exact, a right shift truncates. */
    uint64_t x = n <= NORM_BITS ? v << (NORM_BITS - n) : v >> (n - NORM_BITS);
    uint64_t frac = 0;
    for (uint32_t i = 1; i <= QS_LOSS_LOG_BITS; ++i) {
        x = (x * x) >> NORM_BITS; /* x < 2^31, so x*x < 2^62 */
        if (x >= (1ull << (NORM_BITS + 1u))) {
            x >>= 1;
            frac |= 1ull << (QS_LOSS_LOG_BITS - i);
        }
    }
    return ((uint64_t)n << QS_LOSS_LOG_BITS) | frac;
}

int32_t qs_loss_q16(const int8_t *logits, uint32_t classes, uint32_t label, const qs_loss_params *params)
{
    QS_ASSERT(classes >= 1u && classes <= QS_LOSS_MAX_CLASSES && label < classes);
    int32_t top = logits[0];
    for (uint32_t j = 1; j < classes; ++j) {
        if (logits[j] > top) {
            top = logits[j];
        }
    }
    /* d_j = top - l_j is in [0, 255]; E[0] = 2^24 for the maximum, so sum >= 2^24. */
    uint64_t sum = 0;
    for (uint32_t j = 0; j < classes; ++j) {
        sum += params->exp_table[(uint32_t)(top - logits[j])];
    }
    const uint64_t log2 = qs_ilog2_q24(sum) - ((uint64_t)QS_LOSS_TABLE_BITS << QS_LOSS_LOG_BITS);
    /* log2 < 2^30 (sum < 2^38 gives log2 of the ratio < 14 * 2^24), times a 32-bit
     * constant stays below 2^62. */
    const uint64_t ln_q24 = (log2 * QS_LOSS_LN2_Q32 + (1ull << 31)) >> 32;
    const uint64_t d_y = (uint64_t)(top - logits[label]);
    /* S < 2^28 and d_y <= 255: below 2^36; ln_q24 < 2^30. */
    const uint64_t total = ln_q24 + (uint64_t)params->scale_q24 * d_y;
    const uint32_t shift = QS_LOSS_LOG_BITS - QS_LOSS_FRAC_BITS;
    /* total < 2^37, so the Q16 result is below 2^29: fits int32. */
    return (int32_t)((total + (1ull << (shift - 1u))) >> shift);
}
