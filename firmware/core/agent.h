/*
 * The board agent: the board side of the protocol over a serial link (COBS frames,
 * acks, retransmission), and the state machine of qsched.firmware.virtual.board in C:
 * LoadModel / SelectDataset / JobConfig make the board ready, SetWeights resynchronises
 * it, EvalRequest / EvalSliceRequest / ApplyUpdate / ValidateRequest run the training
 * steps.
 *
 * No heap: the agent is one static object; the model, the weights, the accumulation
 * buffer and the activations live in the port's model region, split as
 *
 *   [ blob | weights P | buffer 2P | perturbed copy P | staging 3P | arena ]
 *
 * where P is the length of the flat trainable vector, laid out after the blob's actual
 * length when a model is installed (a new blob drops the old state anyway; the same
 * blob again has the same length and leaves the weights after it untouched).
 */
#ifndef QS_AGENT_H
#define QS_AGENT_H

#include <stddef.h>
#include <stdint.h>

#include "codec.h"
#include "dataset.h"
#include "frame.h"
#include "model.h"
#include "qs_status.h"
#include "update.h"

#define QS_MAX_BATCH 4096u
#define QS_RX_QUEUE 4u                      /* data frames acknowledged but not yet handled */
#define QS_ACK_TIMEOUT_US 100000u           /* protocol.framing.ACK_TIMEOUT_S */
#define QS_MAX_RETRIES 16u                  /* protocol.framing.MAX_RETRIES */
#define QS_HEARTBEAT_INTERVAL_US 5000000u   /* unsolicited Heartbeat period */
#define QS_POLL_US 100000u                  /* idle wait for input */
#define QS_VALIDATION_CHUNK 1024u           /* loss sums are added per chunk, as Workload.validate */
#define QS_RX_READ_BYTES 256u               /* bytes taken from the port per read */

typedef struct {
    uint8_t payload[QS_MAX_PAYLOAD];
    size_t len;
} qs_rx_slot;

/* A chunked transfer (LoadModel, SetWeights) being reassembled in order. */
typedef struct {
    int active;
    uint32_t total, crc, job_id, step;
    uint32_t received;
} qs_transfer;

typedef struct {
    /* link */
    qs_frame_reader reader;
    uint16_t tx_seq;
    int tx_syn;
    int have_last_rx;
    uint16_t last_rx_seq;
    int last_rx_syn;
    size_t rx_partial; /* bytes of a segmented message joined so far (in the next free slot) */
    int ack_seen;
    uint16_t ack_seq;
    qs_rx_slot queue[QS_RX_QUEUE];
    uint32_t queue_head, queue_count;
    uint8_t wire[QS_SEGMENT_WIRE_FRAME]; /* an outgoing frame: a segment or an ACK */
    uint8_t tx_payload[QS_MAX_PAYLOAD];
    uint8_t rx_bytes[QS_RX_READ_BYTES];
    qs_msg rx, tx;
    qs_msg hb;     /* heartbeats have their own message: one may go out mid-computation */
    int computing; /* an evaluation or validation is running: report busy */
    int link_gone;
    int hello_acked; /* the peer acknowledged our Hello */
    uint64_t last_heartbeat_us;
    uint64_t boot_us;

    /* memory */
    uint8_t *region;
    size_t region_size;
    size_t blob_cap;

    /* what the board holds */
    qs_dataset dataset;
    int dataset_ok;      /* the port's data set parsed */
    int dataset_selected;
    int model_ok;
    uint64_t model_hash;
    uint32_t model_crc, model_len;
    qs_model model;
    int config_ok;
    qs_msg config; /* the JobConfig */
    int state_ok;  /* weights, buffer and step are valid */
    uint32_t step;
    int8_t *weights;
    uint16_t *buffer; /* FP16 buffer (2P bytes); INT8 accumulator: P int8 values + T shifts */
    uint32_t tensor_sizes[QS_MODEL_MAX_OPS]; /* the flat vector's tensors (trainable ops) */
    qs_gain gains[QS_MODEL_MAX_OPS];         /* their channel gains (lr_unit "weight") */
    uint32_t ntensors;
    /* Scale recalibration (SPEC "Scale recalibration"): one exponent per trainable
     * channel, and the channels' shifts, biases and scales the model runs with. */
    uint32_t nchannels;
    int8_t *exps;
    int32_t *channel_shift, *channel_bias;
    float *channel_scales;
    int rescaled; /* some exponent is not 0: the NPU's compiled scales no longer hold */
    int8_t *work;
    uint8_t *staging;
    qs_transfer model_rx, weights_rx;
    int have_last_update;
    uint32_t last_update_job, last_update_step, last_update_crc, last_update_checksum;
    uint32_t batch[QS_MAX_BATCH];
} qs_agent;

/* Set up an agent on the port's model region and data set (NULL if none). */
void qs_agent_init(qs_agent *a, uint8_t *region, size_t region_size, const uint8_t *dataset, size_t dataset_len);

/* Serve the link until it is gone (returns QS_ERR_IO) — never returns on a board. */
qs_status qs_agent_run(qs_agent *a);

#endif
