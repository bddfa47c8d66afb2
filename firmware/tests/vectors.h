/*
 * Runner for the protocol's line-based test vectors (the .txt files in protocol/vectors), shared
 * by the host test tool and the Cortex-M55 self-test image. One line = one case:
 * "<kind> <fields...>"; '#' starts a comment. Kinds this runner does not know are
 * counted as skipped, so a newer vector file never breaks an older firmware.
 */
#ifndef QS_VECTORS_H
#define QS_VECTORS_H

#include <stddef.h>
#include <stdint.h>

#define QS_VECTOR_KINDS_MAX 24
#define QS_VECTOR_KIND_LEN 16

typedef struct {
    char name[QS_VECTOR_KIND_LEN];
    uint32_t passed;
    uint32_t failed;
} qs_vector_kind_count;

typedef struct {
    qs_vector_kind_count kinds[QS_VECTOR_KINDS_MAX];
    uint32_t nkinds;
    uint32_t skipped;      /* lines of unknown kinds */
    uint32_t first_failed; /* 1-based line number of the first failure, 0 if none */
} qs_vector_report;

/* Called for each failing line (may be NULL): line number and the line's text. */
typedef void (*qs_vector_fail_fn)(uint32_t line, const char *text, size_t len);

/* Run every line of text; fills report. Returns the total number of failures. */
uint32_t qs_vectors_run(const char *text, size_t len, qs_vector_report *report, qs_vector_fail_fn on_fail);

#endif
