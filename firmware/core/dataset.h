/*
 * The data set a C board holds (qsched.zo.blob dataset blob, "QZDS"): int8 inputs
 * already quantised with the model's input parameters, uint8 labels. Parsed in place.
 */
#ifndef QS_DATASET_H
#define QS_DATASET_H

#include <stddef.h>
#include <stdint.h>

#include "qs_status.h"

#define QS_DATASET_HEADER_SIZE 72u

typedef struct {
    uint32_t rank;
    uint32_t dims[3];
    uint32_t sample;  /* int8 values per sample */
    uint32_t classes;
    uint32_t n_train, n_val;
    const int8_t *x_train;
    const uint8_t *y_train;
    const int8_t *x_val;
    const uint8_t *y_val;
    uint64_t hash64; /* first 8 bytes of the content hash, LE (SelectDataset.dataset_hash) */
} qs_dataset;

/* Parse and validate a dataset blob (untrusted): lengths, shape, labels < classes. */
qs_status qs_dataset_parse(const uint8_t *blob, size_t len, qs_dataset *ds);

#endif
