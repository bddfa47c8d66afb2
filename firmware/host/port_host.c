/*
 * Port layer for a POSIX host: the serial link is a file descriptor (a pseudo-terminal
 * or a USB serial device), time is CLOCK_MONOTONIC, the model region a static array.
 */
#define _XOPEN_SOURCE 700 /* posix_openpt, grantpt, unlockpt, ptsname */
#include "port_host.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "codec.h"
#include "port.h"

#define HOST_MODEL_REGION_BYTES (64u << 20)
#define HOST_DATASET_MAX_BYTES (256u << 20)

static uint8_t g_region[HOST_MODEL_REGION_BYTES] __attribute__((aligned(16)));
static int g_fd = -1;
static int g_pty_mode;   /* we own a pty master: an absent peer is waited for, never "gone" */
static int g_pty_slave = -1;
static uint64_t g_start_ns;
static uint8_t *g_dataset;
static size_t g_dataset_len;
static char g_board_id[33] = "c-host";

static uint64_t monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Raw 8-bit mode: no echo, no line editing, no CR/LF translation. */
static void make_raw(int fd)
{
    struct termios t;
    if (tcgetattr(fd, &t) != 0) {
        return; /* not a terminal (a pipe or socket in tests): nothing to configure */
    }
    t.c_iflag &= ~(tcflag_t)(IGNBRK | BRKINT | PARMRK | ISTRIP | INLCR | IGNCR | ICRNL | IXON | IXOFF);
    t.c_oflag &= ~(tcflag_t)OPOST;
    t.c_lflag &= ~(tcflag_t)(ECHO | ECHONL | ICANON | ISIG | IEXTEN);
    t.c_cflag &= ~(tcflag_t)(CSIZE | PARENB);
    t.c_cflag |= CS8 | CREAD | CLOCAL;
    t.c_cc[VMIN] = 1;
    t.c_cc[VTIME] = 0;
    tcsetattr(fd, TCSANOW, &t);
}

static int load_file(const char *path, uint8_t **data, size_t *len)
{
    FILE *fp = fopen(path, "rb");
    if (fp == NULL) {
        return 0;
    }
    uint8_t *buf = malloc(HOST_DATASET_MAX_BYTES); /* once at start-up, before the agent runs */
    const size_t n = buf ? fread(buf, 1, HOST_DATASET_MAX_BYTES, fp) : 0u;
    const int ok = buf != NULL && ferror(fp) == 0 && feof(fp);
    fclose(fp);
    if (!ok) {
        free(buf);
        return 0;
    }
    *data = buf;
    *len = n;
    return 1;
}

/*
 * Allocate a pseudo-terminal, as QEMU's "-chardev pty" does: the board serves the master
 * side and link names the slave side for the daemon. The board keeps the slave open
 * (in raw mode, so nothing is echoed before the daemon configures it) so that a daemon
 * that comes and goes never makes the master read as an error.
 */
static int open_pty(const char *link)
{
    g_fd = posix_openpt(O_RDWR | O_NOCTTY);
    if (g_fd < 0 || grantpt(g_fd) != 0 || unlockpt(g_fd) != 0) {
        fprintf(stderr, "qs_board: cannot allocate a pty: %s\n", strerror(errno));
        return 0;
    }
    const char *slave = ptsname(g_fd);
    g_pty_slave = slave ? open(slave, O_RDWR | O_NOCTTY) : -1;
    if (g_pty_slave < 0) {
        fprintf(stderr, "qs_board: cannot open the pty's slave side: %s\n", strerror(errno));
        return 0;
    }
    make_raw(g_pty_slave);
    fcntl(g_fd, F_SETFL, fcntl(g_fd, F_GETFL) | O_NONBLOCK);
    unlink(link);
    if (symlink(slave, link) != 0) {
        fprintf(stderr, "qs_board: cannot link %s -> %s: %s\n", link, slave, strerror(errno));
        return 0;
    }
    printf("qs_board: serving %s (link %s)\n", slave, link);
    fflush(stdout);
    g_pty_mode = 1;
    return 1;
}

int qs_host_configure(const char *device, const char *pty_link, const char *dataset_path, const char *board_id)
{
    if (pty_link != NULL) {
        if (!open_pty(pty_link)) {
            return 0;
        }
    } else {
        g_fd = open(device, O_RDWR | O_NOCTTY);
        if (g_fd < 0) {
            fprintf(stderr, "qs_board: cannot open %s: %s\n", device, strerror(errno));
            return 0;
        }
        make_raw(g_fd);
    }
    if (dataset_path != NULL && !load_file(dataset_path, &g_dataset, &g_dataset_len)) {
        fprintf(stderr, "qs_board: cannot read data set %s\n", dataset_path);
        return 0;
    }
    if (board_id != NULL) {
        strncpy(g_board_id, board_id, sizeof g_board_id - 1u);
    }
    return 1;
}

qs_status qs_port_init(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    g_start_ns = monotonic_ns();
    return g_fd >= 0 ? QS_OK : QS_ERR_IO;
}

void qs_port_info_get(qs_port_info *info)
{
    info->board_id = g_board_id;
    info->firmware = "qsched-fw-host/0.1";
    info->npu = QS_NPU_NONE;
    info->ram_kib = HOST_MODEL_REGION_BYTES / 1024u;
}

qs_status qs_port_serial_write(const uint8_t *data, size_t len)
{
    while (len > 0u) {
        const ssize_t n = write(g_fd, data, len);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0 && g_pty_mode && errno == EAGAIN) {
            /* Nobody reads the pty: wait a little, then drop the bytes as a UART with
             * no one listening would; the link layer retransmits what matters. */
            struct pollfd p = {g_fd, POLLOUT, 0};
            if (poll(&p, 1, 100) <= 0) {
                return QS_OK;
            }
            continue;
        }
        if (n <= 0) {
            return QS_ERR_IO;
        }
        data += n;
        len -= (size_t)n;
    }
    return QS_OK;
}

qs_status qs_port_serial_read(uint8_t *buf, size_t cap, size_t *got, uint32_t timeout_us)
{
    *got = 0;
    struct pollfd p = {g_fd, POLLIN, 0};
    const int ready = poll(&p, 1, (int)((timeout_us + 999u) / 1000u));
    if (ready < 0) {
        return errno == EINTR ? QS_OK : QS_ERR_IO;
    }
    if (ready == 0) {
        return QS_OK;
    }
    const ssize_t n = read(g_fd, buf, cap);
    if (n < 0 && g_pty_mode && (errno == EAGAIN || errno == EIO)) {
        return QS_OK;
    }
    if (n <= 0) {
        /* No data after poll said readable: the other side is gone (unplugged). */
        return (n < 0 && (errno == EINTR || errno == EAGAIN)) ? QS_OK : QS_ERR_IO;
    }
    *got = (size_t)n;
    return QS_OK;
}

uint64_t qs_port_now_us(void)
{
    return (monotonic_ns() - g_start_ns) / 1000u;
}

qs_status qs_port_npu_forward(const qs_model *model, const int8_t *input, const int8_t *flat,
                              const int8_t **logits)
{
    (void)model;
    (void)input;
    (void)flat;
    (void)logits;
    return QS_ERR_UNSUPPORTED; /* no NPU: the CPU reference kernels run */
}

void *qs_port_model_region(size_t *size)
{
    *size = sizeof g_region;
    return g_region;
}

const uint8_t *qs_port_dataset(size_t *len)
{
    *len = g_dataset_len;
    return g_dataset;
}

uint32_t qs_port_entropy(void)
{
    return (uint32_t)monotonic_ns() ^ ((uint32_t)getpid() << 16);
}

void qs_port_log(const char *text)
{
    fprintf(stderr, "qs_board: %s\n", text);
}

#ifndef NDEBUG
void qs_assert_failed(const char *file, int line, const char *cond)
{
    fprintf(stderr, "qs_board: assertion failed at %s:%d: %s\n", file, line, cond);
    abort();
}
#endif
