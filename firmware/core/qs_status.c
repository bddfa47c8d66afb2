#include "qs_status.h"

const char *qs_status_name(qs_status status)
{
    switch (status) {
    case QS_OK: return "ok";
    case QS_ERR_ARG: return "bad-argument";
    case QS_ERR_TOO_LARGE: return "too-large";
    case QS_ERR_FORMAT: return "bad-format";
    case QS_ERR_CRC: return "bad-crc";
    case QS_ERR_ORDER: return "bad-order";
    case QS_ERR_UNSUPPORTED: return "unsupported";
    case QS_ERR_STATE: return "bad-state";
    case QS_ERR_IO: return "io-error";
    }
    return "unknown";
}
