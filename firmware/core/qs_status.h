/*
 * Status codes and the two tiers of checks used throughout the firmware.
 *
 * Tier 1, untrusted input (bytes from the serial link, a model blob, an update
 * message): every function that reads such input returns a qs_status and never
 * trusts a length, index or enum it did not check.
 *
 * Tier 2, invariants the code itself guarantees (a buffer the caller sized with a
 * named constant, a shape that Prepare already validated): QS_ASSERT, compiled in
 * for the host and sanitizer builds, compiled out with NDEBUG.
 */
#ifndef QS_STATUS_H
#define QS_STATUS_H

typedef enum {
    QS_OK = 0,
    QS_ERR_ARG = 1,         /* a field is out of its documented range */
    QS_ERR_TOO_LARGE = 2,   /* input exceeds a buffer sized by a named constant */
    QS_ERR_FORMAT = 3,      /* malformed bytes: truncated, bad magic, bad encoding */
    QS_ERR_CRC = 4,         /* integrity check failed */
    QS_ERR_ORDER = 5,       /* update pairs not in strictly ascending k */
    QS_ERR_UNSUPPORTED = 6, /* a valid but unimplemented option (op, mode) */
    QS_ERR_STATE = 7,       /* request not valid in the agent's current state */
    QS_ERR_IO = 8           /* the port layer failed to read or write */
} qs_status;

/* A short, stable, human name for a status (never NULL). */
const char *qs_status_name(qs_status status);

#ifdef NDEBUG
#define QS_ASSERT(cond) ((void)0)
#else
void qs_assert_failed(const char *file, int line, const char *cond);
#define QS_ASSERT(cond) ((cond) ? (void)0 : qs_assert_failed(__FILE__, __LINE__, #cond))
#endif

#endif /* QS_STATUS_H */
