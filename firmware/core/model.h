/*
 * The INT8 model runtime: parses a model blob (qsched.zo.blob, "QZMB") in place,
 * validates every record once (Prepare), then runs forward passes with the reference
 * kernels (Eval: integer-only, no allocation, cannot fail).
 *
 * Memory: the blob stays where it was received and is never written; the trainable
 * weights a forward pass uses come from a flat vector the caller owns (the master
 * weights or a perturbed copy). Prepare places the activation arena in the scratch
 * region it is given.
 */
#ifndef QS_MODEL_H
#define QS_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"
#include "loss.h"
#include "qs_status.h"

#define QS_MODEL_MAX_TENSORS 256u
#define QS_MODEL_MAX_OPS 128u
#define QS_MODEL_MAX_RANK 3u
#define QS_MODEL_MAX_CLASSES 256u /* labels travel as uint8 */
#define QS_BLOB_HEADER_SIZE 64u
#define QS_BLOB_TABLE_SIZE (4u * QS_LOSS_TABLE_SIZE)
#define QS_BLOB_TENSOR_SIZE 52u
#define QS_BLOB_OP_SIZE 140u

enum {
    QS_OP_CONV = 1, QS_OP_DEPTHWISE = 2, QS_OP_DENSE = 3, QS_OP_RELU = 4, QS_OP_RELU6 = 5,
    QS_OP_ADD = 6, QS_OP_AVGPOOL = 7, QS_OP_MAXPOOL = 8, QS_OP_GLOBALAVG = 9, QS_OP_RESHAPE = 10,
    QS_OP_MEAN = 11, QS_OP_PAD = 12, QS_OP_CONCAT = 13, QS_OP_MUL = 14,
    QS_OP_LOGISTIC = 15, QS_OP_HARD_SWISH = 16, QS_OP_MUL_CONSTANT = 17
};

typedef struct {
    uint32_t rank;
    uint32_t dims[QS_MODEL_MAX_RANK];
    uint32_t size;         /* elements per sample */
    uint32_t arena_offset; /* where the tensor lives in the activation arena */
    uint32_t scale_bits;
    int32_t zero_point;
} qs_tensor;

typedef struct {
    uint32_t opcode;
    uint32_t in0, in1, out; /* tensor indices; in1 only for Add, Concat and Mul */
    uint32_t trainable;
    uint32_t param_offset; /* flat index of the weights (trainable ops) */
    uint32_t weight_count;
    const int8_t *weight;  /* the blob's weights (initial values of trainable ones) */
    const int32_t *bias;
    const float *scales; /* per-channel weight scales (conv, dense): the weight-unit lr's gains */
    uint32_t channels;
    qs_requant rq;
    /* The blob's own biases, scales and shifts: bias, scales and rq.shift point here
     * until qs_model_use_channels points a trainable op elsewhere. */
    const int32_t *blob_bias;
    const float *blob_scales;
    const int32_t *blob_shift;
    qs_conv_params conv;
    qs_fc_params fc;
    qs_pool_params pool;
    qs_add_params add;
    qs_requant_params relu;
    qs_mean_params mean;
    qs_pad_params pad;
    uint32_t concat_a, concat_b; /* channels of each input of a Concat */
    qs_mul_params mul;
    const int8_t *table; /* LOGISTIC, HARD_SWISH, MUL by a constant: 256 outputs, by input + 128 */
    qs_shape in_shape, filter_shape, out_shape;
} qs_op;

typedef struct {
    uint8_t *blob;
    size_t blob_len;
    uint32_t n_tensors, n_ops;
    uint32_t input, output;
    uint32_t num_classes;
    uint32_t num_params; /* length of the flat trainable vector */
    uint32_t single_rounding;
    qs_loss_params loss;
    qs_tensor tensors[QS_MODEL_MAX_TENSORS];
    qs_op ops[QS_MODEL_MAX_OPS];
    int8_t *arena; /* activations of one sample */
    size_t arena_size;
} qs_model;

/*
 * Validate the blob (untrusted) and prepare every op. scratch receives the activation
 * arena. Returns QS_ERR_FORMAT / QS_ERR_ARG for a bad
 * blob, QS_ERR_UNSUPPORTED for FP32 blobs or unknown ops, QS_ERR_TOO_LARGE when the
 * scratch region is too small.
 */
qs_status qs_model_prepare(qs_model *m, uint8_t *blob, size_t len, int8_t *scratch, size_t scratch_size);

/* Forward one sample (input: the input tensor's size in int8). The trainable ops take
 * their weights from flat (num_params int8: the master weights or a perturbed copy);
 * NULL uses the blob's own weights. Returns the logits (num_classes int8 values). */
const int8_t *qs_model_forward(qs_model *m, const int8_t *input, const int8_t *flat);

/* Copy the blob's trainable weights into a flat vector (num_params int8). */
void qs_model_get_flat(const qs_model *m, int8_t *flat);

/* The trainable ops' output channels, summed in op order. */
uint32_t qs_model_trainable_channels(const qs_model *m);

/*
 * Make the trainable ops requantise with shift[], add bias[] and report scales[] (one
 * value per channel, the ops' channels in op order) instead of the blob's: scale
 * recalibration (SPEC "Scale recalibration") changes these while the blob, which is
 * never written, keeps the calibrated values. The arrays must outlive the model.
 */
void qs_model_use_channels(qs_model *m, const int32_t *shift, const int32_t *bias, const float *scales);

#endif
