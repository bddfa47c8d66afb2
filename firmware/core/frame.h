/*
 * Serial framing (qsched.protocol.framing): on the wire 00 | COBS(raw) | 00, raw =
 * flags u8 | seq u16 | payload | crc32 u32 (CRC over flags, seq, payload). A message
 * travels in segments, all but the last flagged MORE. Stop-and-wait per direction: a
 * data frame is acknowledged by an ACK frame with its seq.
 */
#ifndef QS_FRAME_H
#define QS_FRAME_H

#include <stddef.h>
#include <stdint.h>

#include "cobs.h"
#include "codec.h"
#include "qs_status.h"

#define QS_FLAG_ACK 0x01u
#define QS_FLAG_SYN 0x02u
#define QS_FLAG_MORE 0x04u /* the message continues in the next data frame */
#define QS_SEGMENT_BYTES 256u /* the longest segment this firmware sends (<= MAX_SEGMENT 1024) */
#define QS_FRAME_OVERHEAD 7u /* flags, seq, crc32 */
#define QS_MAX_RAW_FRAME (QS_FRAME_OVERHEAD + QS_MAX_PAYLOAD)
#define QS_MAX_ENCODED_FRAME (QS_MAX_RAW_FRAME + QS_MAX_RAW_FRAME / 254u + 1u)
#define QS_MAX_WIRE_FRAME (QS_MAX_ENCODED_FRAME + 2u) /* with both delimiters */
/* The longest frame this firmware sends: one segment, COBS-encoded, with delimiters. */
#define QS_SEGMENT_RAW_FRAME (QS_FRAME_OVERHEAD + QS_SEGMENT_BYTES)
#define QS_SEGMENT_WIRE_FRAME (QS_SEGMENT_RAW_FRAME + QS_SEGMENT_RAW_FRAME / 254u + 3u)

typedef struct {
    uint16_t seq;
    uint8_t flags;
    const uint8_t *payload; /* into the reader's buffer: valid until the next feed */
    size_t len;
} qs_frame;

/* Encode one frame with both delimiters into out (cap >= QS_MAX_WIRE_FRAME suffices). */
qs_status qs_frame_encode(uint16_t seq, uint8_t flags, const uint8_t *payload, size_t len, uint8_t *out,
                          size_t cap, size_t *out_len);

/* Decode the COBS bytes of one frame (between delimiters, untrusted) in place.
 * QS_ERR_TOO_LARGE (oversized), QS_ERR_FORMAT (bad framing), QS_ERR_CRC. */
qs_status qs_frame_decode(uint8_t *encoded, size_t len, qs_frame *frame);

/* Splits a byte stream into frames, resynchronising at every 00. */
typedef struct {
    uint8_t buf[QS_MAX_ENCODED_FRAME];
    size_t len;
    int discarding; /* an over-long run: dropped until the next delimiter */
} qs_frame_reader;

void qs_frame_reader_init(qs_frame_reader *r);

/*
 * Take one byte. Returns QS_OK with *done = 1 and *frame filled when the byte completed
 * a good frame; an error status (with *done = 1) when it completed a bad one; *done = 0
 * otherwise. The frame's payload points into r->buf until the next call.
 */
qs_status qs_frame_reader_push(qs_frame_reader *r, uint8_t byte, qs_frame *frame, int *done);

#endif
