#include "agent.h"

#include <string.h>

#include "crc32.h"
#include "loss.h"
#include "port.h"
#include "prng.h"
#include "sha256.h"
#include "update.h"

/* ------------------------------------------------------------------ link layer */

static void queue_frame(qs_agent *a, const qs_frame *fr)
{
    size_t n = 0;
    /* An ACK of our own is written at once; the peer's next frame waits for it. */
    if (qs_frame_encode(fr->seq, QS_FLAG_ACK, NULL, 0, a->wire, sizeof a->wire, &n) == QS_OK &&
        qs_port_serial_write(a->wire, n) != QS_OK) {
        a->link_gone = 1;
    }
}

/* A good data frame arrived: acknowledge, drop a retransmission, queue the payload. */
static void on_data_frame(qs_agent *a, const qs_frame *fr)
{
    const int syn = (fr->flags & QS_FLAG_SYN) != 0u;
    if (a->have_last_rx && a->last_rx_seq == fr->seq && a->last_rx_syn == syn) {
        queue_frame(a, fr); /* our ACK was lost: acknowledge again */
        return;
    }
    if (a->queue_count == QS_RX_QUEUE) {
        return; /* no ACK: the peer sends it again later */
    }
    /* Segments are joined in the next free slot; SYN drops a message the peer gave up. */
    qs_rx_slot *slot = &a->queue[(a->queue_head + a->queue_count) % QS_RX_QUEUE];
    if (syn) {
        a->rx_partial = 0;
    }
    /* A message may grow past what one may have (a faulty peer, SPEC 7.3): keep the true
     * length, so the decoder answers too_large, but copy no more than the slot holds. */
    const size_t at = a->rx_partial;
    if (at < QS_MAX_PAYLOAD) {
        const size_t room = QS_MAX_PAYLOAD - at;
        memcpy(slot->payload + at, fr->payload, fr->len < room ? fr->len : room);
    }
    a->rx_partial = at + fr->len > QS_MAX_ENCODED_FRAME ? QS_MAX_ENCODED_FRAME : at + fr->len;
    if ((fr->flags & QS_FLAG_MORE) == 0u) {
        slot->len = a->rx_partial;
        a->rx_partial = 0;
        ++a->queue_count;
    }
    a->have_last_rx = 1;
    a->last_rx_seq = fr->seq;
    a->last_rx_syn = syn;
    queue_frame(a, fr);
}

/* Read what the link has (waiting up to timeout_us for the first byte) and act on
 * every completed frame. Bad frames are skipped: the sender retransmits. */
static void poll_link(qs_agent *a, uint32_t timeout_us)
{
    size_t got = 0;
    if (a->link_gone || qs_port_serial_read(a->rx_bytes, sizeof a->rx_bytes, &got, timeout_us) != QS_OK) {
        a->link_gone = 1;
        return;
    }
    for (size_t i = 0; i < got; ++i) {
        qs_frame fr;
        int done = 0;
        if (qs_frame_reader_push(&a->reader, a->rx_bytes[i], &fr, &done) != QS_OK || !done) {
            continue;
        }
        if (fr.flags & QS_FLAG_ACK) {
            a->ack_seen = 1;
            a->ack_seq = fr.seq;
        } else {
            on_data_frame(a, &fr);
        }
    }
}

/* Send one frame and wait for its ACK, retransmitting (stop-and-wait). After the last
 * retry the frame is dropped and the next one carries SYN (the peer drops the message). */
static int send_frame(qs_agent *a, const uint8_t *payload, size_t len, int more)
{
    size_t n = 0;
    const uint8_t flags = (uint8_t)((a->tx_syn ? QS_FLAG_SYN : 0u) | (more ? QS_FLAG_MORE : 0u));
    if (qs_frame_encode(a->tx_seq, flags, payload, len, a->wire, sizeof a->wire, &n) != QS_OK) {
        return 0;
    }
    const uint16_t seq = a->tx_seq++;
    static uint8_t frame[QS_SEGMENT_WIRE_FRAME]; /* a->wire is reused by the ACKs we send */
    memcpy(frame, a->wire, n);
    for (uint32_t attempt = 0; attempt <= QS_MAX_RETRIES && !a->link_gone; ++attempt) {
        a->ack_seen = 0;
        if (qs_port_serial_write(frame, n) != QS_OK) {
            a->link_gone = 1;
            return 0;
        }
        const uint64_t start = qs_port_now_us();
        while (!a->link_gone && qs_port_now_us() - start < QS_ACK_TIMEOUT_US) {
            poll_link(a, QS_ACK_TIMEOUT_US / 10u);
            if (a->ack_seen && a->ack_seq == seq) {
                a->tx_syn = 0;
                return 1;
            }
        }
    }
    a->tx_syn = 1;
    return 0;
}

/* Send one message in segments of QS_SEGMENT_BYTES; a segment given up loses it. */
static int send_msg(qs_agent *a, const qs_msg *msg)
{
    size_t len = 0;
    if (qs_encode(msg, a->tx_payload, sizeof a->tx_payload, &len) != QS_OK) {
        return 0;
    }
    size_t at = 0;
    do {
        const size_t piece = len - at < QS_SEGMENT_BYTES ? len - at : QS_SEGMENT_BYTES;
        if (!send_frame(a, a->tx_payload + at, piece, at + piece < len)) {
            return 0;
        }
        at += piece;
    } while (at < len);
    return 1;
}

/* ------------------------------------------------------------------ replies */

static void reply_error(qs_agent *a, uint8_t code, uint8_t ref_type, uint32_t job_id, uint32_t step,
                        const char *detail)
{
    qs_msg_init(&a->tx, QS_MSG_ERROR);
    a->tx.code = code;
    a->tx.ref_type = ref_type;
    a->tx.job_id = job_id;
    a->tx.step = step;
    strncpy(a->tx.text_a, detail, QS_TEXT_MAX);
    a->tx.text_a[QS_TEXT_MAX] = '\0';
    send_msg(a, &a->tx);
}

static void reply_loaded(qs_agent *a, uint8_t resource, uint32_t job_id, uint32_t crc, uint32_t size)
{
    qs_msg_init(&a->tx, QS_MSG_LOADED);
    a->tx.resource = resource;
    a->tx.job_id = job_id;
    a->tx.crc32 = crc;
    a->tx.size = size;
    send_msg(a, &a->tx);
}

static uint8_t reported_state(const qs_agent *a)
{
    if (a->computing) {
        return QS_STATE_BUSY;
    }
    if (a->model_rx.active || a->weights_rx.active) {
        return QS_STATE_LOADING;
    }
    return a->state_ok ? QS_STATE_READY : QS_STATE_IDLE;
}

static void send_heartbeat(qs_agent *a, uint32_t nonce)
{
    qs_msg_init(&a->hb, QS_MSG_HEARTBEAT);
    a->hb.nonce = nonce;
    a->hb.uptime_ms = (uint32_t)((qs_port_now_us() - a->boot_us) / 1000u);
    a->hb.state = reported_state(a);
    a->hb.job_id = a->config_ok ? a->config.job_id : 0u;
    a->hb.step = a->state_ok ? a->step : 0u;
    a->last_heartbeat_us = qs_port_now_us();
    send_msg(a, &a->hb);
}

/* During a long computation: answer a Ping at the head of the queue at once (state
 * busy), as the Python board does, so the daemon's liveness check sees the board alive. */
static void answer_pings(qs_agent *a)
{
    while (a->queue_count > 0u) {
        const qs_rx_slot *slot = &a->queue[a->queue_head];
        const uint8_t *p = slot->payload;
        if (slot->len != QS_HEADER_SIZE + 4u || p[0] != 'Q' || p[1] != 'S' || p[2] != QS_PROTOCOL_VERSION ||
            p[3] != QS_MSG_PING) {
            return;
        }
        const uint32_t nonce = (uint32_t)p[4] | ((uint32_t)p[5] << 8) | ((uint32_t)p[6] << 16) | ((uint32_t)p[7] << 24);
        a->queue_head = (a->queue_head + 1u) % QS_RX_QUEUE;
        --a->queue_count;
        send_heartbeat(a, nonce);
    }
}

/* Between samples of a long computation: acknowledge frames, answer pings. */
static void keep_link_alive(qs_agent *a)
{
    poll_link(a, 0);
    answer_pings(a);
}

static void send_hello(qs_agent *a)
{
    qs_port_info info;
    qs_port_info_get(&info);
    qs_msg_init(&a->tx, QS_MSG_HELLO);
    a->tx.npu = info.npu;
    a->tx.ram_kib = info.ram_kib;
    a->tx.max_batch = (uint16_t)QS_MAX_BATCH;
    a->tx.model_hash = a->model_ok ? a->model_hash : 0u;
    a->tx.dataset_hash = a->dataset_selected ? a->dataset.hash64 : 0u;
    strncpy(a->tx.text_a, info.board_id, QS_TEXT_MAX);
    strncpy(a->tx.text_b, info.firmware, QS_TEXT_MAX);
    a->hello_acked = send_msg(a, &a->tx);
}

/* ------------------------------------------------------------------ state */

static int acc8(const qs_agent *a)
{
    return a->config.accumulator == QS_ACC_INT8;
}

static int recalibrates(const qs_agent *a)
{
    return a->config.recalibrate_every != 0u;
}

/* Bytes of the accumulator state: FP16 (2 per weight) or INT8 (1 per weight + shifts). */
static uint32_t buffer_bytes(const qs_agent *a)
{
    return acc8(a) ? a->model.num_params + a->ntensors : 2u * a->model.num_params;
}

/* Bytes of the whole state (SetWeights): weights, buffer, scale exponents. */
static uint32_t state_bytes(const qs_agent *a)
{
    return a->model.num_params + buffer_bytes(a) + (recalibrates(a) ? a->nchannels : 0u);
}

/* The weight checksum (SPEC 5): weights, the accumulator state's bytes, the exponents. */
static uint32_t state_checksum(const qs_agent *a)
{
    const uint32_t crc = qs_crc32_update(0, a->weights, a->model.num_params);
    if (acc8(a)) {
        return qs_crc32_update(crc, a->buffer, buffer_bytes(a));
    }
    const uint32_t with_buffer = qs_crc32_fp16(crc, a->buffer, a->model.num_params);
    return recalibrates(a) ? qs_crc32_update(with_buffer, a->exps, a->nchannels) : with_buffer;
}

/* round_half_away(b / 2^e) in integers (SPEC "Scale recalibration"). */
static int32_t shifted_bias(int32_t b, int32_t e)
{
    if (e == 0) {
        return b;
    }
    const int64_t magnitude = ((b < 0 ? -(int64_t)b : (int64_t)b) + ((int64_t)1 << (e - 1))) >> e;
    return (int32_t)(b < 0 ? -magnitude : magnitude);
}

/* The channels' shifts, biases and scales under the exponents (all 0 without
 * recalibration: the blob's values). */
static void refresh_channels(qs_agent *a)
{
    uint32_t first = 0;
    a->rescaled = 0;
    for (uint32_t i = 0; i < a->model.n_ops; ++i) {
        const qs_op *op = &a->model.ops[i];
        if (!op->trainable) {
            continue;
        }
        for (uint32_t c = 0; c < op->channels; ++c) {
            const int32_t e = recalibrates(a) ? a->exps[first + c] : 0;
            a->channel_shift[first + c] = op->blob_shift[c] + e;
            a->channel_bias[first + c] = shifted_bias(op->blob_bias[c], e);
            /* times a power of two: exact in float32 */
            a->channel_scales[first + c] = op->blob_scales[c] * (float)(1u << e);
            a->rescaled |= e != 0;
        }
        first += op->channels;
    }
}

/* QS_OK when every exponent is in [0, its channel's limit] (SetWeights). */
static qs_status check_exps(const qs_agent *a, const int8_t *exps)
{
    uint32_t first = 0;
    for (uint32_t i = 0; i < a->model.n_ops; ++i) {
        const qs_op *op = &a->model.ops[i];
        for (uint32_t c = 0; op->trainable && c < op->channels; ++c) {
            const int32_t e = exps[first + c];
            if (e < 0 || e > qs_recal_exp_limit(op->rq.multiplier[c], op->blob_shift[c])) {
                return QS_ERR_ARG;
            }
        }
        first += op->trainable ? op->channels : 0u;
    }
    return QS_OK;
}

/* After the update of step: recalibrate every trainable tensor when it is due. */
static void recalibrate_after(qs_agent *a, uint32_t step)
{
    if (!recalibrates(a) || (step + 1u) % a->config.recalibrate_every != 0u) {
        return;
    }
    uint32_t first = 0, grown = 0;
    for (uint32_t i = 0; i < a->model.n_ops; ++i) {
        const qs_op *op = &a->model.ops[i];
        if (op->trainable) {
            grown += qs_recalibrate_fp16(a->weights + op->param_offset, a->buffer + op->param_offset,
                                         op->weight_count, op->channels, op->opcode == QS_OP_DEPTHWISE,
                                         a->exps + first, op->rq.multiplier, op->blob_shift);
            first += op->channels;
        }
    }
    if (grown != 0u) {
        refresh_channels(a);
    }
}

static void drop_state(qs_agent *a)
{
    a->state_ok = 0;
    a->have_last_update = 0;
}

static void clear(qs_agent *a, int dataset)
{
    a->model_ok = 0;
    a->config_ok = 0;
    a->model_rx.active = 0;
    a->weights_rx.active = 0;
    drop_state(a);
    if (dataset) {
        a->dataset_selected = 0;
    }
}

/* Build the initial state once model, data set and job config are all there
 * (virtual_board's _rebuild). Returns 0 and replies with an Error on a mismatch. */
static void rebuild(qs_agent *a)
{
    if (a->state_ok || !a->model_ok || !a->dataset_selected || !a->config_ok) {
        return;
    }
    const qs_tensor *in = &a->model.tensors[a->model.input];
    int shape_ok = in->rank == a->dataset.rank && a->model.num_classes == a->dataset.classes;
    for (uint32_t i = 0; shape_ok && i < in->rank; ++i) {
        shape_ok = in->dims[i] == a->dataset.dims[i];
    }
    if (!shape_ok) {
        reply_error(a, QS_BERR_MODEL_INVALID, QS_MSG_JOB_CONFIG, a->config.job_id, 0,
                    "model input/classes differ from the data set");
        return;
    }
    qs_model_get_flat(&a->model, a->weights);
    memset(a->buffer, 0, 2u * (size_t)a->model.num_params);
    if (acc8(a)) {
        memset((int8_t *)a->buffer + a->model.num_params, QS_ACC8_SHIFT_MIN, a->ntensors);
    }
    memset(a->exps, 0, a->nchannels);
    refresh_channels(a);
    a->step = 0;
    a->state_ok = 1;
    a->have_last_update = 0;
}

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* After the activation arena: the SetWeights staging area (weights, buffer, exponents:
 * 3P + C) and the C channels' exponents, shifts, biases and scales (13C bytes). */
static qs_status place_after_arena(qs_agent *a, uint8_t *p)
{
    const uint64_t params = a->model.num_params;
    a->nchannels = qs_model_trainable_channels(&a->model);
    const uint64_t channels = a->nchannels;
    const uint64_t staging = (3u * params + channels + 15u) & ~(uint64_t)15u;
    const uint64_t need = staging + ((channels + 15u) & ~(uint64_t)15u) + 12u * channels;
    if (need > (uint64_t)(a->region + a->region_size - p)) { /* p is inside the region */
        return QS_ERR_TOO_LARGE;
    }
    a->staging = p;
    p += staging;
    a->exps = (int8_t *)p;
    p += (channels + 15u) & ~(uint64_t)15u;
    a->channel_shift = (int32_t *)(void *)p;
    a->channel_bias = a->channel_shift + channels;
    a->channel_scales = (float *)(void *)(a->channel_bias + channels);
    qs_model_use_channels(&a->model, a->channel_shift, a->channel_bias, a->channel_scales);
    a->ntensors = 0;
    uint32_t first = 0;
    for (uint32_t i = 0; i < a->model.n_ops; ++i) {
        const qs_op *op = &a->model.ops[i];
        if (op->trainable) {
            const qs_gain g = {a->channel_scales + first, op->channels, op->opcode == QS_OP_DEPTHWISE};
            a->gains[a->ntensors] = g;
            a->tensor_sizes[a->ntensors++] = op->weight_count;
            first += op->channels;
        }
    }
    memset(a->exps, 0, a->nchannels);
    refresh_channels(a);
    return QS_OK;
}

/* Lay out the region after the blob for P parameters and prepare the model. */
static qs_status install_model(qs_agent *a, uint32_t len)
{
    if (len < 24u) {
        return QS_ERR_FORMAT;
    }
    const uint64_t params = le32(a->region + 20); /* untrusted until prepare: bounded here */
    const uint64_t after_blob = ((uint64_t)len + 15u) & ~(uint64_t)15u;
    const uint64_t need = after_blob + 7u * params + 64u;
    if (need > a->region_size) {
        return QS_ERR_TOO_LARGE;
    }
    uint8_t *p = a->region + after_blob;
    a->weights = (int8_t *)p;
    p += (params + 15u) & ~(uint64_t)15u;
    a->buffer = (uint16_t *)(void *)p;
    p += (2u * params + 15u) & ~(uint64_t)15u;
    a->work = (int8_t *)p;
    p += (params + 15u) & ~(uint64_t)15u;
    if (p > a->region + a->region_size) {
        return QS_ERR_TOO_LARGE;
    }
    const qs_status st = qs_model_prepare(&a->model, a->region, len, (int8_t *)p,
                                          (size_t)(a->region + a->region_size - p));
    if (st != QS_OK) {
        return st;
    }
    if (a->model.num_params == 0u) {
        return QS_ERR_ARG; /* the blob marks no layer trainable */
    }
    const size_t arena = (a->model.arena_size + 15u) & ~(size_t)15u;
    if (arena > (size_t)(a->region + a->region_size - p)) {
        return QS_ERR_TOO_LARGE;
    }
    return place_after_arena(a, p + arena);
}

/* ------------------------------------------------------------------ loading */

/* Chunks arrive in ascending order (SPEC 6.2); a repeat of a received range is ignored. */
static int transfer_add(qs_agent *a, qs_transfer *t, uint8_t *dst, const qs_msg *m, uint32_t job_id)
{
    if (m->offset + m->chunk_len <= t->received && m->chunk_len != 0u) {
        return 0; /* a duplicate delivery */
    }
    if (m->offset != t->received) {
        t->active = 0;
        reply_error(a, QS_BERR_MALFORMED, m->type, job_id, m->step, "chunks must arrive in order");
        return -1;
    }
    memcpy(dst + m->offset, m->chunk, m->chunk_len);
    t->received += m->chunk_len;
    return t->received == t->total ? 1 : 0;
}

static void on_load_model(qs_agent *a, const qs_msg *m)
{
    if (m->total > a->blob_cap) {
        reply_error(a, QS_BERR_TOO_LARGE, m->type, 0, 0, "model blob larger than this board's memory");
        return;
    }
    qs_transfer *t = &a->model_rx;
    /* A chunk at offset 0 starts a new transfer (SPEC 6.2). */
    if (!t->active || t->total != m->total || t->crc != m->crc32 || m->offset == 0u) {
        if (m->offset != 0u) {
            reply_error(a, QS_BERR_MALFORMED, m->type, 0, 0, "model transfer must start at offset 0");
            return;
        }
        memset(t, 0, sizeof *t);
        t->active = 1;
        t->total = m->total;
        t->crc = m->crc32;
        a->model_ok = 0; /* the blob area is being overwritten */
    }
    const int done = transfer_add(a, t, a->region, m, 0);
    if (done <= 0) {
        return;
    }
    t->active = 0;
    const uint64_t hash = qs_sha256_id(a->region, m->total);
    if (qs_crc32_update(0, a->region, m->total) != m->crc32) {
        reply_error(a, QS_BERR_CRC_MISMATCH, m->type, 0, 0, "model CRC differs");
        return;
    }
    const int same = a->model_crc == m->crc32 && a->model_len == m->total && a->model_hash == hash;
    const qs_status st = install_model(a, m->total);
    if (st != QS_OK) {
        drop_state(a);
        reply_error(a, st == QS_ERR_TOO_LARGE ? QS_BERR_NO_MEMORY : QS_BERR_MODEL_INVALID, m->type, 0, 0,
                    qs_status_name(st));
        return;
    }
    a->model_ok = 1;
    if (!same) { /* the same blob again keeps the weights and step */
        drop_state(a);
    }
    a->model_hash = hash;
    a->model_crc = m->crc32;
    a->model_len = m->total;
    reply_loaded(a, QS_RES_MODEL, 0, m->crc32, m->total);
    rebuild(a);
}

static void on_select_dataset(qs_agent *a, const qs_msg *m)
{
    if (!a->dataset_ok || a->dataset.hash64 != m->dataset_hash || a->dataset.n_train != m->train_size ||
        a->dataset.n_val != m->val_size) {
        reply_error(a, QS_BERR_DATASET_MISSING, m->type, 0, 0, "this board does not hold that data set");
        return;
    }
    if (!a->dataset_selected) {
        a->dataset_selected = 1;
        drop_state(a);
    }
    reply_loaded(a, QS_RES_DATASET, 0, (uint32_t)m->dataset_hash, m->train_size + m->val_size);
    rebuild(a);
}

static int same_config(const qs_msg *x, const qs_msg *y)
{
    return x->job_id == y->job_id && x->seed == y->seed && x->numerics == y->numerics &&
           x->estimator == y->estimator && x->accumulator == y->accumulator && x->batch_size == y->batch_size &&
           x->lr_unit == y->lr_unit && x->recalibrate_every == y->recalibrate_every &&
           memcmp(&x->eps, &y->eps, sizeof x->eps) == 0;
}

static void on_job_config(qs_agent *a, const qs_msg *m, const uint8_t *raw, size_t raw_len)
{
    if (m->batch_size == 0u || m->batch_size > QS_MAX_BATCH) {
        reply_error(a, QS_BERR_MALFORMED, m->type, m->job_id, 0, "batch size outside [1, 4096]");
        return;
    }
    if (!a->config_ok || !same_config(&a->config, m)) {
        a->config = *m;
        a->config_ok = 1;
        drop_state(a);
    }
    reply_loaded(a, QS_RES_JOB_CONFIG, m->job_id, qs_crc32_update(0, raw, raw_len), (uint32_t)raw_len);
    /* This firmware computes INT8 jobs; eps is a whole number of int8 steps. */
    if (m->numerics != QS_NUM_INT8 || !(m->eps >= 1.0f && m->eps <= 127.0f) || (float)(int32_t)m->eps != m->eps) {
        a->config_ok = 0;
        reply_error(a, QS_BERR_MODEL_INVALID, m->type, m->job_id, 0, "this firmware runs int8 jobs with whole eps");
        return;
    }
    if (m->recalibrate_every != 0u && m->accumulator != QS_ACC_FP16) {
        a->config_ok = 0;
        reply_error(a, QS_BERR_MODEL_INVALID, m->type, m->job_id, 0, "recalibration needs the FP16 buffer");
        return;
    }
    rebuild(a);
}

/* Is the board ready for job_id? Replies with the Error when not. */
static int ready(qs_agent *a, const qs_msg *m)
{
    if (!a->config_ok) {
        reply_error(a, QS_BERR_NOT_READY, m->type, m->job_id, 0, "no job config");
        return 0;
    }
    if (m->job_id != a->config.job_id) {
        reply_error(a, QS_BERR_UNKNOWN_JOB, m->type, m->job_id, 0, "another job is configured");
        return 0;
    }
    /* model_ok drops while a new blob is being received over the old one. */
    if (!a->state_ok || !a->model_ok) {
        reply_error(a, QS_BERR_NOT_READY, m->type, m->job_id, 0, "missing model or dataset");
        return 0;
    }
    return 1;
}

static int step_ok(qs_agent *a, const qs_msg *m)
{
    if (m->step != a->step) {
        reply_error(a, QS_BERR_STALE_STEP, m->type, m->job_id, m->step, "request is not for the board's step");
        return 0;
    }
    return 1;
}

static void on_set_weights(qs_agent *a, const qs_msg *m)
{
    if (!ready(a, m)) {
        return;
    }
    const uint32_t params = a->model.num_params;
    qs_transfer *t = &a->weights_rx;
    if (!t->active || t->total != m->total || t->crc != m->checksum || t->job_id != m->job_id ||
        t->step != m->step || m->offset == 0u) {
        if (m->total != state_bytes(a)) {
            reply_error(a, QS_BERR_MALFORMED, m->type, m->job_id, m->step, "weights size differs from the job's");
            return;
        }
        memset(t, 0, sizeof *t);
        t->active = 1;
        t->total = m->total;
        t->crc = m->checksum;
        t->job_id = m->job_id;
        t->step = m->step;
    }
    const int done = transfer_add(a, t, a->staging, m, m->job_id);
    if (done <= 0) {
        return;
    }
    t->active = 0;
    if (qs_crc32_update(0, a->staging, m->total) != m->checksum) {
        reply_error(a, QS_BERR_CRC_MISMATCH, m->type, m->job_id, m->step, "weights CRC differs");
        return;
    }
    if (acc8(a)) {
        for (uint32_t tensor = 0; tensor < a->ntensors; ++tensor) {
            const int8_t shift = (int8_t)a->staging[2u * params + tensor];
            if (shift < QS_ACC8_SHIFT_MIN || shift > QS_ACC8_SHIFT_MAX) {
                reply_error(a, QS_BERR_MALFORMED, m->type, m->job_id, m->step, "accumulator shift outside [7, 15]");
                return;
            }
        }
        memcpy(a->buffer, a->staging + params, buffer_bytes(a));
    } else {
        const int8_t *exps = (const int8_t *)a->staging + 3u * params;
        if (recalibrates(a) && check_exps(a, exps) != QS_OK) {
            reply_error(a, QS_BERR_MALFORMED, m->type, m->job_id, m->step, "scale exponent outside its range");
            return;
        }
        for (uint32_t i = 0; i < params; ++i) { /* little-endian binary16 */
            a->buffer[i] = (uint16_t)(a->staging[params + 2u * i] | (a->staging[params + 2u * i + 1u] << 8));
        }
        if (recalibrates(a)) {
            memcpy(a->exps, exps, a->nchannels);
            refresh_channels(a);
        }
    }
    memcpy(a->weights, a->staging, params);
    a->step = m->step;
    a->have_last_update = 0;
    reply_loaded(a, QS_RES_WEIGHTS, m->job_id, m->checksum, m->total);
}

/* ------------------------------------------------------------------ one step */

/* One sample's logits: on the NPU when the port has one for this model, else on the CPU. */
static const int8_t *forward(qs_agent *a, const int8_t *input, const int8_t *flat)
{
    const int8_t *logits = NULL;
    if (!a->rescaled && qs_port_npu_forward(&a->model, input, flat, &logits) == QS_OK) {
        return logits;
    }
    return qs_model_forward(&a->model, input, flat);
}

/* Sum of the Q16 losses of batch positions [first, first + count) of the step's batch
 * under the flat weights: the whole batch for an EvalRequest, a slice for an
 * EvalSliceRequest (SPEC 6.10). At most QS_MAX_BATCH losses, each a non-negative
 * int32: the sum stays far below 2^63. */
static int64_t loss_sum(qs_agent *a, const int8_t *flat, uint32_t first, uint32_t count)
{
    int64_t sum = 0;
    for (uint32_t j = first; j < first + count; ++j) {
        const uint32_t idx = a->batch[j];
        const int8_t *logits = forward(a, a->dataset.x_train + (size_t)idx * a->dataset.sample, flat);
        sum += qs_loss_q16(logits, a->model.num_classes, a->dataset.y_train[idx], &a->model.loss);
        if ((j & 7u) == 7u) {
            keep_link_alive(a);
        }
    }
    return sum;
}

/* The mean of a whole batch's Q16 loss sum, as float32 (exact below 256). */
static float mean_loss(int64_t sum, uint32_t batch)
{
    /* Losses are non-negative: C's truncating division is the floor the SPEC asks for. */
    return (float)((double)(sum / (int64_t)batch) / 65536.0);
}

/* loss_sum at the weights plus sign * eps * z_k of the board's step. */
static int64_t perturbed_sum(qs_agent *a, uint32_t k, int32_t eps, int32_t sign, uint32_t first, uint32_t count)
{
    const qs_stream s = {a->config.seed, a->step};
    (void)qs_perturb_int8(a->weights, a->work, a->model.num_params, 0, s, k, eps, sign);
    return loss_sum(a, a->work, first, count);
}

/* An EvalRequest's or EvalSliceRequest's checks (replying with the Error when one
 * fails); then draws the step's batch indices. */
static int eval_ready(qs_agent *a, const qs_msg *m)
{
    if (!ready(a, m) || !step_ok(a, m)) {
        return 0;
    }
    if (m->batch_size != a->config.batch_size || memcmp(&m->eps, &a->config.eps, sizeof m->eps) != 0 ||
        m->estimator != a->config.estimator) {
        reply_error(a, QS_BERR_MALFORMED, m->type, m->job_id, m->step, "batch/eps/estimator differ from the job's");
        return 0;
    }
    (void)qs_batch_indices(a->config.seed, m->step, m->batch_size, a->dataset.n_train, a->batch);
    return 1;
}

/* Fill in what every evaluation answer echoes, and send it. */
static void send_eval_answer(qs_agent *a, uint8_t type, const qs_msg *m, uint64_t start_us)
{
    a->tx.type = type;
    a->tx.job_id = m->job_id;
    a->tx.step = m->step;
    a->tx.estimator = m->estimator;
    a->tx.nks = m->nks;
    memcpy(a->tx.ks, m->ks, sizeof(uint16_t) * m->nks);
    const uint64_t us = qs_port_now_us() - start_us;
    a->tx.compute_us = us > UINT32_MAX ? UINT32_MAX : (uint32_t)us;
    send_msg(a, &a->tx);
}

static void on_eval(qs_agent *a, const qs_msg *m)
{
    if (!eval_ready(a, m)) {
        return;
    }
    const uint64_t start = qs_port_now_us();
    a->computing = 1;
    const int32_t eps = (int32_t)m->eps;
    const uint32_t batch = m->batch_size;
    const int two_sided = m->estimator == QS_EST_TWO_SIDED;
    qs_msg_init(&a->tx, QS_MSG_EVAL_RESULT);
    for (uint16_t i = 0; i < m->nks; ++i) {
        a->tx.seq_a[i] = mean_loss(perturbed_sum(a, m->ks[i], eps, 1, 0, batch), batch);
        if (two_sided) {
            a->tx.seq_b[i] = mean_loss(perturbed_sum(a, m->ks[i], eps, -1, 0, batch), batch);
        }
    }
    if (!two_sided) {
        a->tx.loss_zero = mean_loss(loss_sum(a, a->weights, 0, batch), batch);
    }
    a->computing = 0;
    send_eval_answer(a, QS_MSG_EVAL_RESULT, m, start);
}

/* The sums of a slice of the batch (SPEC 6.10). This firmware holds INT8 jobs only (a
 * JobConfig for FP32 is refused), so there is no FP32 mode to refuse slices in. */
static void on_eval_slice(qs_agent *a, const qs_msg *m)
{
    if (!eval_ready(a, m)) {
        return;
    }
    /* The codec checked first + count <= batch_size, and eval_ready that it is the job's. */
    const uint32_t first = m->slice_start, count = m->slice_count;
    QS_ASSERT(first + count <= a->config.batch_size);
    const uint64_t start = qs_port_now_us();
    a->computing = 1;
    const int32_t eps = (int32_t)m->eps;
    const int two_sided = m->estimator == QS_EST_TWO_SIDED;
    qs_msg_init(&a->tx, QS_MSG_EVAL_SLICE_RESULT);
    for (uint16_t i = 0; i < m->nks; ++i) {
        a->tx.sum_plus[i] = (uint64_t)perturbed_sum(a, m->ks[i], eps, 1, first, count);
        if (two_sided) {
            a->tx.sum_minus[i] = (uint64_t)perturbed_sum(a, m->ks[i], eps, -1, first, count);
        }
    }
    if (!two_sided) {
        a->tx.sum_zero = (uint64_t)loss_sum(a, a->weights, first, count);
    }
    a->computing = 0;
    a->tx.slice_start = m->slice_start;
    a->tx.slice_count = m->slice_count;
    send_eval_answer(a, QS_MSG_EVAL_SLICE_RESULT, m, start);
}

static uint32_t update_key(const qs_msg *m)
{
    uint32_t crc = qs_crc32_update(0, m->ks, sizeof(uint16_t) * m->nks);
    return qs_crc32_update(crc, m->seq_a, sizeof(float) * m->nks);
}

static void send_update_ack(qs_agent *a, uint32_t job_id, uint32_t step, uint32_t checksum)
{
    qs_msg_init(&a->tx, QS_MSG_UPDATE_ACK);
    a->tx.job_id = job_id;
    a->tx.step = step;
    a->tx.checksum = checksum;
    send_msg(a, &a->tx);
}

/* The update of one step (SPEC 4.2): the whole flat vector, or tensor by tensor when
 * each tensor's channels scale it (lr_unit "weight"). */
static qs_status apply_pairs(qs_agent *a, uint32_t step, const qs_pair *pairs, uint32_t npairs)
{
    const qs_stream s = {a->config.seed, step};
    const int weight_units = a->config.lr_unit == QS_LR_WEIGHT;
    if (acc8(a)) {
        int8_t *buf8 = (int8_t *)a->buffer;
        return qs_apply_int8_acc8(a->weights, buf8, buf8 + a->model.num_params, a->tensor_sizes, a->ntensors, s,
                                  pairs, npairs, weight_units ? a->gains : NULL);
    }
    if (!weight_units) {
        return qs_apply_int8_fp16(a->weights, a->buffer, a->model.num_params, 0, s, pairs, npairs, NULL);
    }
    uint32_t first = 0;
    for (uint32_t t = 0; t < a->ntensors; ++t) {
        const qs_status st = qs_apply_int8_fp16(a->weights + first, a->buffer + first, a->tensor_sizes[t], first, s,
                                                pairs, npairs, &a->gains[t]);
        if (st != QS_OK) {
            return st;
        }
        first += a->tensor_sizes[t];
    }
    return QS_OK;
}

static void on_apply_update(qs_agent *a, const qs_msg *m)
{
    static qs_pair pairs[QS_MAX_KS];
    if (!ready(a, m)) {
        return;
    }
    const uint32_t key = update_key(m);
    if (a->have_last_update && a->last_update_job == m->job_id && a->last_update_step == m->step &&
        a->last_update_crc == key) {
        send_update_ack(a, m->job_id, m->step, a->last_update_checksum); /* a duplicate delivery */
        return;
    }
    if (!step_ok(a, m)) {
        return;
    }
    for (uint16_t i = 0; i < m->nks; ++i) {
        pairs[i].k = m->ks[i];
        pairs[i].c = m->seq_a[i];
    }
    const qs_status st = apply_pairs(a, m->step, pairs, m->nks);
    if (st != QS_OK) {
        reply_error(a, QS_BERR_MALFORMED, m->type, m->job_id, m->step, "update refused");
        return;
    }
    recalibrate_after(a, m->step);
    a->step = m->step + 1u;
    const uint32_t checksum = state_checksum(a);
    a->have_last_update = 1;
    a->last_update_job = m->job_id;
    a->last_update_step = m->step;
    a->last_update_crc = key;
    a->last_update_checksum = checksum;
    send_update_ack(a, m->job_id, m->step, checksum);
}

/* Index of the largest logit, the first one on ties (numpy's argmax). */
static uint32_t argmax(const int8_t *logits, uint32_t n)
{
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; ++i) {
        if (logits[i] > logits[best]) {
            best = i;
        }
    }
    return best;
}

static void on_validate(qs_agent *a, const qs_msg *m)
{
    if (!ready(a, m) || !step_ok(a, m)) {
        return;
    }
    const uint32_t n_val = a->dataset.n_val;
    if (m->start >= n_val) {
        reply_error(a, QS_BERR_MALFORMED, m->type, m->job_id, m->step, "validation start beyond the data set");
        return;
    }
    const uint64_t start = qs_port_now_us();
    const uint32_t stop = m->count > n_val - m->start ? n_val : m->start + m->count;
    double loss_sum = 0.0;
    uint32_t correct = 0;
    a->computing = 1;
    for (uint32_t lo = m->start; lo < stop; lo += QS_VALIDATION_CHUNK) {
        const uint32_t hi = stop - lo > QS_VALIDATION_CHUNK ? lo + QS_VALIDATION_CHUNK : stop;
        int64_t chunk = 0;
        for (uint32_t i = lo; i < hi; ++i) {
            const int8_t *logits = forward(a, a->dataset.x_val + (size_t)i * a->dataset.sample, a->weights);
            chunk += qs_loss_q16(logits, a->model.num_classes, a->dataset.y_val[i], &a->model.loss);
            correct += argmax(logits, a->model.num_classes) == a->dataset.y_val[i];
            if ((i & 7u) == 7u) {
                keep_link_alive(a);
            }
        }
        loss_sum += (double)chunk / 65536.0;
    }
    a->computing = 0;
    qs_msg_init(&a->tx, QS_MSG_VALIDATE_RESULT);
    a->tx.job_id = m->job_id;
    a->tx.step = m->step;
    a->tx.start = m->start;
    a->tx.count = stop - m->start;
    a->tx.loss_sum = loss_sum;
    a->tx.correct = correct;
    const uint64_t us = qs_port_now_us() - start;
    a->tx.compute_us = us > UINT32_MAX ? UINT32_MAX : (uint32_t)us;
    send_msg(a, &a->tx);
}

/* ------------------------------------------------------------------ dispatch */

static uint8_t decode_error_code(qs_decode_error err)
{
    switch (err) {
    case QS_DEC_UNSUPPORTED_VERSION: return QS_BERR_UNSUPPORTED_VERSION;
    case QS_DEC_UNKNOWN_TYPE: return QS_BERR_UNKNOWN_TYPE;
    case QS_DEC_OVERSIZED: return QS_BERR_TOO_LARGE;
    default: return QS_BERR_MALFORMED;
    }
}

static void handle_payload(qs_agent *a, const uint8_t *payload, size_t len)
{
    qs_decode_error err;
    const char *detail = NULL;
    if (qs_decode(payload, len, &a->rx, &err, &detail) != QS_OK) {
        /* Oversized: no byte of it is read, as in every implementation (SPEC 6.4). */
        const int typed = len >= QS_HEADER_SIZE && err != QS_DEC_BAD_MAGIC && err != QS_DEC_OVERSIZED;
        const uint8_t ref = typed ? payload[3] : 0u;
        reply_error(a, decode_error_code(err), ref, 0, 0, detail != NULL ? detail : qs_decode_error_name(err));
        return;
    }
    const qs_msg *m = &a->rx;
    switch (m->type) {
    case QS_MSG_LOAD_MODEL: on_load_model(a, m); break;
    case QS_MSG_SET_WEIGHTS: on_set_weights(a, m); break;
    case QS_MSG_SELECT_DATASET: on_select_dataset(a, m); break;
    case QS_MSG_JOB_CONFIG: on_job_config(a, m, payload, len); break;
    case QS_MSG_EVAL_REQUEST: on_eval(a, m); break;
    case QS_MSG_EVAL_SLICE_REQUEST: on_eval_slice(a, m); break;
    case QS_MSG_APPLY_UPDATE: on_apply_update(a, m); break;
    case QS_MSG_VALIDATE_REQUEST: on_validate(a, m); break;
    case QS_MSG_PING: send_heartbeat(a, m->nonce); break;
    case QS_MSG_RESET:
        clear(a, m->scope == 1u);
        if (m->scope == 1u) {
            a->boot_us = qs_port_now_us();
        }
        send_hello(a);
        break;
    case QS_MSG_ERROR: break; /* never answer an Error with an Error */
    default:
        reply_error(a, QS_BERR_UNKNOWN_TYPE, m->type, 0, 0, "not a daemon-to-board message");
        break;
    }
}

void qs_agent_init(qs_agent *a, uint8_t *region, size_t region_size, const uint8_t *dataset, size_t dataset_len)
{
    memset(a, 0, sizeof *a);
    qs_frame_reader_init(&a->reader);
    a->region = region;
    a->region_size = region_size;
    a->blob_cap = region_size;
    a->tx_seq = (uint16_t)qs_port_entropy();
    a->tx_syn = 1;
    a->boot_us = qs_port_now_us();
    a->dataset_ok = dataset != NULL && qs_dataset_parse(dataset, dataset_len, &a->dataset) == QS_OK;
}

qs_status qs_agent_run(qs_agent *a)
{
    send_hello(a);
    a->last_heartbeat_us = qs_port_now_us();
    while (!a->link_gone) {
        if (a->queue_count > 0u) {
            qs_rx_slot *slot = &a->queue[a->queue_head];
            a->queue_head = (a->queue_head + 1u) % QS_RX_QUEUE;
            --a->queue_count;
            if (!a->hello_acked) {
                send_hello(a); /* the peer came late (a pty opened after boot): Hello first */
            }
            handle_payload(a, slot->payload, slot->len);
            continue;
        }
        poll_link(a, QS_POLL_US);
        if (qs_port_now_us() - a->last_heartbeat_us >= QS_HEARTBEAT_INTERVAL_US) {
            send_heartbeat(a, 0);
        }
    }
    return QS_ERR_IO;
}
