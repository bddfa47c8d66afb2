/*
 * Binary data-plane codec (qsched.protocol.codec): 4-byte header "QS", version, type;
 * then fixed-width little-endian fields. Table-driven: one descriptor list per message
 * type, walked by one bounds-checked cursor. Decoding never allocates; byte strings
 * (chunks) point into the input buffer, which must outlive the message.
 */
#ifndef QS_CODEC_H
#define QS_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "qs_status.h"

#define QS_PROTOCOL_VERSION 2u
#define QS_MAX_PAYLOAD 12288u /* largest encoded message, header included */
#define QS_MAX_CHUNK 8192u    /* largest LoadModel / SetWeights chunk */
#define QS_MAX_KS 1024u       /* most sample keys in one message */
#define QS_MAX_SLICE_KS 512u  /* most keys in an EvalSliceRequest / EvalSliceResult */
#define QS_HEADER_SIZE 4u
#define QS_TEXT_MAX 64u

enum {
    QS_MSG_HELLO = 0x01,
    QS_MSG_HEARTBEAT = 0x02,
    QS_MSG_EVAL_RESULT = 0x03,
    QS_MSG_UPDATE_ACK = 0x04,
    QS_MSG_VALIDATE_RESULT = 0x05,
    QS_MSG_LOADED = 0x06,
    QS_MSG_EVAL_SLICE_RESULT = 0x07,
    QS_MSG_LOAD_MODEL = 0x41,
    QS_MSG_SET_WEIGHTS = 0x42,
    QS_MSG_SELECT_DATASET = 0x43,
    QS_MSG_JOB_CONFIG = 0x44,
    QS_MSG_EVAL_REQUEST = 0x45,
    QS_MSG_APPLY_UPDATE = 0x46,
    QS_MSG_VALIDATE_REQUEST = 0x47,
    QS_MSG_PING = 0x48,
    QS_MSG_RESET = 0x49,
    QS_MSG_EVAL_SLICE_REQUEST = 0x4B,
    QS_MSG_ERROR = 0x7F
};

/* Enum values, in wire order (index = code). */
enum { QS_EST_TWO_SIDED = 0, QS_EST_ONE_SIDED = 1 };
enum { QS_NUM_FP32 = 0, QS_NUM_INT8 = 1 };
enum { QS_ACC_FP16 = 0, QS_ACC_INT8 = 1 };
enum { QS_LR_INT8_STEP = 0, QS_LR_WEIGHT = 1 };
enum { QS_NPU_NONE = 0, QS_NPU_NEURAL_ART = 1, QS_NPU_VIRTUAL = 2 };
enum { QS_STATE_IDLE = 0, QS_STATE_LOADING, QS_STATE_READY, QS_STATE_BUSY, QS_STATE_FAULT };
enum { QS_RES_MODEL = 0, QS_RES_WEIGHTS, QS_RES_DATASET, QS_RES_JOB_CONFIG };
enum {
    QS_BERR_INTERNAL = 0, QS_BERR_UNSUPPORTED_VERSION, QS_BERR_MALFORMED, QS_BERR_UNKNOWN_TYPE,
    QS_BERR_UNKNOWN_JOB, QS_BERR_STALE_STEP, QS_BERR_NOT_READY, QS_BERR_BUSY, QS_BERR_CRC_MISMATCH,
    QS_BERR_TOO_LARGE, QS_BERR_NO_MEMORY, QS_BERR_NUMERIC, QS_BERR_DATASET_MISSING, QS_BERR_MODEL_INVALID
};

/* Why a decode failed: the names of qsched.protocol.errors.ERROR_KINDS. */
typedef enum {
    QS_DEC_OK = 0,
    QS_DEC_TRUNCATED,
    QS_DEC_OVERSIZED,
    QS_DEC_TRAILING_BYTES,
    QS_DEC_BAD_MAGIC,
    QS_DEC_UNSUPPORTED_VERSION,
    QS_DEC_UNKNOWN_TYPE,
    QS_DEC_INVALID_FIELD
} qs_decode_error;

/* Every field of every message; a message uses the ones its layout names. */
typedef struct {
    uint8_t type;
    uint8_t npu, state, estimator, resource, code, ref_type, numerics, accumulator, scope, lr_unit;
    uint16_t protocol_version, max_batch, batch_size;
    uint32_t job_id, step, nonce, uptime_ms, compute_us, checksum, crc32, size, total, offset;
    uint32_t start, count, correct, ram_kib, max_payload, train_size, val_size, recalibrate_every;
    uint64_t seed, model_hash, dataset_hash;
    float eps, loss_zero;
    double loss_sum;
    char text_a[QS_TEXT_MAX + 1]; /* board_id, name, detail */
    char text_b[QS_TEXT_MAX + 1]; /* firmware_version */
    const uint8_t *chunk;         /* LoadModel/SetWeights bytes (into the decoded buffer) */
    uint16_t chunk_len;
    uint16_t nks;
    uint16_t slice_start, slice_count; /* EvalSliceRequest / EvalSliceResult */
    uint16_t ks[QS_MAX_KS];
    /* The per-key values. No message carries both float32 values and u64 sums, so they
     * share memory: the agent holds four messages, and the sums would otherwise add
     * 8 KiB to each. A slice message has at most QS_MAX_SLICE_KS keys, so sum_plus and
     * sum_minus fill exactly the two float arrays; sum_zero (one-sided) takes the place
     * of sum_minus (two-sided), as no message has both. */
    union {
        struct {
            float seq_a[QS_MAX_KS]; /* loss_plus or coefficients */
            float seq_b[QS_MAX_KS]; /* loss_minus */
        };
        struct {
            uint64_t sum_plus[QS_MAX_SLICE_KS];
            union {
                uint64_t sum_minus[QS_MAX_SLICE_KS];
                uint64_t sum_zero;
            };
        };
    };
} qs_msg;

_Static_assert(2u * QS_MAX_SLICE_KS * sizeof(uint64_t) == 2u * QS_MAX_KS * sizeof(float),
               "the slice sums must fit the float arrays they share memory with");

/* Decode one message (untrusted bytes). On failure *err says why and *detail (may be
 * NULL) a short reason; returns QS_ERR_FORMAT. */
qs_status qs_decode(const uint8_t *data, size_t len, qs_msg *msg, qs_decode_error *err, const char **detail);

/* Encode msg (fields of msg->type) into out. QS_ERR_TOO_LARGE beyond cap or
 * QS_MAX_PAYLOAD; QS_ERR_ARG for an unknown type or more keys than the type allows. */
qs_status qs_encode(const qs_msg *msg, uint8_t *out, size_t cap, size_t *len);

/* The ERROR_KINDS name of a decode error ("truncated", ...). */
const char *qs_decode_error_name(qs_decode_error err);

/* Zero a message and set its type. */
void qs_msg_init(qs_msg *msg, uint8_t type);

/* Field access by wire name, for the test vectors: writes the field's value in the
 * vector files' text form into out. Returns 0 if the message has no such field. */
int qs_msg_field_text(const qs_msg *msg, const char *name, char *out, size_t cap);

/* The wire name of a type code ("hello", ...) or NULL. */
const char *qs_msg_type_name(uint8_t type);

#endif
