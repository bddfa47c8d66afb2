#include "cobs.h"

qs_status qs_cobs_encode(const uint8_t *src, size_t len, uint8_t *dst, size_t cap, size_t *out_len)
{
    if (cap < QS_COBS_MAX_ENCODED(len)) {
        return QS_ERR_TOO_LARGE;
    }
    size_t code_at = 0; /* where the current block's code byte goes */
    size_t o = 1;
    uint8_t code = 1;
    int open_block = 1; /* a code byte is reserved at code_at and not yet written */
    for (size_t i = 0; i < len; ++i) {
        if (!open_block) {
            code_at = o++;
            code = 1;
            open_block = 1;
        }
        if (src[i] != 0u) {
            dst[o++] = src[i];
            ++code;
        }
        if (src[i] == 0u || code == 0xFFu) {
            dst[code_at] = code;
            /* A zero always opens a block (it may end the data: "...01"); a full
             * block opens one only if data follows, as canonical COBS does. */
            open_block = 0;
            if (src[i] == 0u) {
                code_at = o++;
                code = 1;
                open_block = 1;
            }
        }
    }
    if (open_block) {
        dst[code_at] = code;
    }
    *out_len = o;
    return QS_OK;
}

qs_status qs_cobs_decode(const uint8_t *src, size_t len, uint8_t *dst, size_t cap, size_t *out_len)
{
    size_t i = 0;
    size_t o = 0;
    while (i < len) {
        const uint8_t code = src[i++];
        if (code == 0u || (size_t)(code - 1u) > len - i) {
            return QS_ERR_FORMAT;
        }
        for (uint8_t n = 1; n < code; ++n) {
            if (src[i] == 0u) {
                return QS_ERR_FORMAT;
            }
            if (o >= cap) {
                return QS_ERR_TOO_LARGE;
            }
            dst[o++] = src[i++];
        }
        /* A block shorter than 254 data bytes stands for a zero, except at the end. */
        if (code != 0xFFu && i < len) {
            if (o >= cap) {
                return QS_ERR_TOO_LARGE;
            }
            dst[o++] = 0u;
        }
    }
    *out_len = o;
    return QS_OK;
}
