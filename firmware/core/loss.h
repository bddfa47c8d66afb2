/*
 * Softmax cross-entropy in integer arithmetic from int8 logits (protocol/SPEC.md,
 * "Integer loss"; Python reference qsched.zo.intloss). No libm: the exp table and the
 * Q24 scale come with the model, so every platform computes the same bits.
 */
#ifndef QS_LOSS_H
#define QS_LOSS_H

#include <stdint.h>

#include "qs_status.h"

#define QS_LOSS_TABLE_SIZE 256u  /* one exp entry per logit difference 0..255 */
#define QS_LOSS_TABLE_BITS 24u   /* E[0] = 2^24 */
#define QS_LOSS_LOG_BITS 24u     /* fractional bits of the log */
#define QS_LOSS_FRAC_BITS 16u    /* a reported loss is Q16 */
#define QS_LOSS_LN2_Q32 0xB17217F8u
#define QS_LOSS_MAX_CLASSES 4096u /* sum of E[d] <= 4096 * 2^24 < 2^36: far below 2^62 */

/* What the loss needs from the model: the output scale as an exp table and in Q24. */
typedef struct {
    uint32_t exp_table[QS_LOSS_TABLE_SIZE];
    uint32_t scale_q24; /* round(s * 2^24), s < 16 so S < 2^28 */
} qs_loss_params;

/* Validate loss parameters from an untrusted model blob: E[0] = 2^24, E non-increasing
 * and S < 2^28. */
qs_status qs_loss_check(const qs_loss_params *params);

/* log2(v) * 2^24, truncated as the SPEC's ilog2_q24; v must be in [1, 2^62). */
uint64_t qs_ilog2_q24(uint64_t v);

/*
 * The Q16 loss of one sample. label must be < classes, classes in [1,
 * QS_LOSS_MAX_CLASSES] (checked by the caller: QS_ASSERT here).
 */
int32_t qs_loss_q16(const int8_t *logits, uint32_t classes, uint32_t label, const qs_loss_params *params);

#endif
