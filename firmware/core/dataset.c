#include "dataset.h"

#include <string.h>

static uint32_t le16(const uint8_t *p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8); }
static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static uint64_t padded(uint64_t n)
{
    return (n + 3u) & ~(uint64_t)3u;
}

static int labels_ok(const uint8_t *y, uint32_t n, uint32_t classes)
{
    for (uint32_t i = 0; i < n; ++i) {
        if (y[i] >= classes) {
            return 0;
        }
    }
    return 1;
}

qs_status qs_dataset_parse(const uint8_t *blob, size_t len, qs_dataset *ds)
{
    memset(ds, 0, sizeof *ds);
    if (len < QS_DATASET_HEADER_SIZE || memcmp(blob, "QZDS", 4) != 0 || le16(blob + 4) != 1u) {
        return QS_ERR_FORMAT;
    }
    ds->rank = le16(blob + 6);
    ds->n_train = le32(blob + 8);
    ds->n_val = le32(blob + 12);
    ds->sample = le32(blob + 16);
    ds->classes = le16(blob + 20);
    uint64_t product = 1;
    if (ds->rank == 0u || ds->rank > 3u || ds->classes == 0u || ds->classes > 256u || ds->n_train == 0u) {
        return QS_ERR_ARG;
    }
    for (uint32_t i = 0; i < 3u; ++i) {
        ds->dims[i] = le16(blob + 24 + 2 * i);
        if (i < ds->rank) {
            product *= ds->dims[i];
        }
    }
    if (product != ds->sample || product == 0u) {
        return QS_ERR_ARG;
    }
    const uint64_t xt = (uint64_t)ds->n_train * ds->sample, xv = (uint64_t)ds->n_val * ds->sample;
    if (QS_DATASET_HEADER_SIZE + padded(xt) + padded(ds->n_train) + padded(xv) + padded(ds->n_val) != len) {
        return QS_ERR_FORMAT;
    }
    const uint8_t *p = blob + QS_DATASET_HEADER_SIZE;
    ds->x_train = (const int8_t *)p;
    p += padded(xt);
    ds->y_train = p;
    p += padded(ds->n_train);
    ds->x_val = (const int8_t *)p;
    p += padded(xv);
    ds->y_val = p;
    for (uint32_t i = 0; i < 8u; ++i) {
        ds->hash64 |= (uint64_t)blob[40 + i] << (8u * i);
    }
    if (!labels_ok(ds->y_train, ds->n_train, ds->classes) || !labels_ok(ds->y_val, ds->n_val, ds->classes)) {
        return QS_ERR_ARG;
    }
    return QS_OK;
}
