#include "frame.h"

#include "crc32.h"

qs_status qs_frame_encode(uint16_t seq, uint8_t flags, const uint8_t *payload, size_t len, uint8_t *out,
                          size_t cap, size_t *out_len)
{
    /* The raw frame is built in out's tail, then COBS-encoded to its head: the encoded
     * form is never shorter, and encoding reads ahead of where it writes only if there
     * is room; keep it simple and safe with a separate static scratch buffer. */
    static uint8_t raw[QS_MAX_RAW_FRAME];
    if (len > QS_MAX_PAYLOAD || (flags & (uint8_t)~(QS_FLAG_ACK | QS_FLAG_SYN | QS_FLAG_MORE)) != 0u ||
        ((flags & QS_FLAG_ACK) != 0u && flags != QS_FLAG_ACK)) {
        return QS_ERR_ARG;
    }
    raw[0] = flags;
    raw[1] = (uint8_t)seq;
    raw[2] = (uint8_t)(seq >> 8);
    for (size_t i = 0; i < len; ++i) {
        raw[3 + i] = payload[i];
    }
    const uint32_t crc = qs_crc32_update(0, raw, 3 + len);
    for (unsigned b = 0; b < 4u; ++b) {
        raw[3 + len + b] = (uint8_t)(crc >> (8u * b));
    }
    if (cap < 2u) {
        return QS_ERR_TOO_LARGE;
    }
    size_t enc = 0;
    out[0] = 0u;
    const qs_status st = qs_cobs_encode(raw, len + QS_FRAME_OVERHEAD, out + 1, cap - 2u, &enc);
    if (st != QS_OK) {
        return st;
    }
    out[1 + enc] = 0u;
    *out_len = enc + 2u;
    return QS_OK;
}

qs_status qs_frame_decode(uint8_t *encoded, size_t len, qs_frame *frame)
{
    size_t raw_len = 0;
    if (len > QS_MAX_ENCODED_FRAME) {
        return QS_ERR_TOO_LARGE;
    }
    qs_status st = qs_cobs_decode(encoded, len, encoded, len, &raw_len);
    if (st != QS_OK) {
        return QS_ERR_FORMAT;
    }
    if (raw_len < QS_FRAME_OVERHEAD) {
        return QS_ERR_FORMAT;
    }
    const size_t body = raw_len - 4u;
    const uint32_t crc = (uint32_t)encoded[body] | ((uint32_t)encoded[body + 1] << 8) |
                         ((uint32_t)encoded[body + 2] << 16) | ((uint32_t)encoded[body + 3] << 24);
    if (qs_crc32_update(0, encoded, body) != crc) {
        return QS_ERR_CRC;
    }
    frame->flags = encoded[0];
    frame->seq = (uint16_t)(encoded[1] | (encoded[2] << 8));
    frame->payload = encoded + 3;
    frame->len = body - 3u;
    /* Undefined bits, or an ACK with a payload or any other flag (SPEC 7.3). */
    if ((frame->flags & (uint8_t)~(QS_FLAG_ACK | QS_FLAG_SYN | QS_FLAG_MORE)) != 0u ||
        ((frame->flags & QS_FLAG_ACK) != 0u && (frame->len != 0u || frame->flags != QS_FLAG_ACK))) {
        return QS_ERR_FORMAT;
    }
    return QS_OK;
}

void qs_frame_reader_init(qs_frame_reader *r)
{
    r->len = 0;
    r->discarding = 0;
}

qs_status qs_frame_reader_push(qs_frame_reader *r, uint8_t byte, qs_frame *frame, int *done)
{
    *done = 0;
    if (byte != 0u) {
        if (r->discarding) {
            return QS_OK;
        }
        if (r->len == sizeof r->buf) {
            r->len = 0;
            r->discarding = 1;
            *done = 1;
            return QS_ERR_TOO_LARGE;
        }
        r->buf[r->len++] = byte;
        return QS_OK;
    }
    if (r->discarding || r->len == 0u) { /* end of a dropped run, or an empty frame */
        r->discarding = 0;
        r->len = 0;
        return QS_OK;
    }
    const size_t n = r->len;
    r->len = 0;
    *done = 1;
    return qs_frame_decode(r->buf, n, frame);
}
