/*
 * qs_board: the C board agent on a POSIX host, serving the protocol on a serial device
 * (a pseudo-terminal in tests). The daemon cannot tell it from an STM32N6 board.
 *
 *   qs_board <serial device> [--dataset FILE.qzds] [--board-id ID]
 *   qs_board --pty LINK [--dataset FILE.qzds] [--board-id ID]
 *   qs_board --help
 *
 * With --pty the board allocates a pseudo-terminal, links its slave side at LINK (what
 * the daemon opens, as it would /dev/ttyACM0) and serves until killed. On a device, it
 * exits with status 0 when the link closes (the other side went away). Status 2: bad
 * usage or set-up failure.
 */
#include <stdio.h>
#include <string.h>

#include "agent.h"
#include "port.h"
#include "port_host.h"

static qs_agent g_agent;

/* Hello.board_id on the wire: [A-Za-z0-9_.-]{1,32}. */
static int board_id_ok(const char *id)
{
    const size_t n = strlen(id);
    if (n == 0u || n > 32u) {
        return 0;
    }
    for (size_t i = 0; i < n; ++i) {
        const char c = id[i];
        if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
              c == '.' || c == '-')) {
            return 0;
        }
    }
    return 1;
}

#define QS_USAGE "usage: qs_board (<serial device> | --pty LINK) [--dataset FILE.qzds] [--board-id ID]\n"

static int usage(void)
{
    fputs(QS_USAGE, stderr);
    return 2;
}

/* --help: the options in words, on stdout, status 0 (what users of any CLI expect). */
static int help(void)
{
    fputs(QS_USAGE
          "\nThe qsched board agent on this host: serves the wire protocol (COBS frames, CRC-32)\n"
          "on a serial device until the link closes, or on its own pseudo-terminal until killed.\n\n"
          "  <serial device>     a tty to serve, e.g. /dev/ttyACM0 or a pseudo-terminal\n"
          "  --pty LINK          allocate a pseudo-terminal and link its slave side at LINK\n"
          "  --dataset FILE      a data set blob (.qzds) the board holds from the start\n"
          "  --board-id ID       Hello.board_id, [A-Za-z0-9_.-]{1,32}\n"
          "  -h, --help          this text\n\n"
          "Exit status: 0 when the link closes, 2 on bad usage or set-up failure.\n",
          stdout);
    return 0;
}

int main(int argc, char **argv)
{
    const char *device = NULL, *pty_link = NULL, *dataset = NULL, *board_id = NULL;
    for (int i = 1; i < argc; ++i) {
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            return help();
        }
        if (strcmp(argv[i], "--pty") == 0 && i + 1 < argc) {
            pty_link = argv[++i];
        } else if (strcmp(argv[i], "--dataset") == 0 && i + 1 < argc) {
            dataset = argv[++i];
        } else if (strcmp(argv[i], "--board-id") == 0 && i + 1 < argc) {
            board_id = argv[++i];
        } else if (argv[i][0] != '-' && device == NULL) {
            device = argv[i];
        } else {
            return usage();
        }
    }
    if (board_id != NULL && !board_id_ok(board_id)) {
        fprintf(stderr, "qs_board: board id must match [A-Za-z0-9_.-]{1,32}, got '%s'\n", board_id);
        return usage();
    }
    if ((device == NULL) == (pty_link == NULL)) {
        return usage();
    }
    if (!qs_host_configure(device, pty_link, dataset, board_id) || qs_port_init(argc, argv) != QS_OK) {
        return 2;
    }
    size_t region_size = 0, dataset_len = 0;
    uint8_t *region = qs_port_model_region(&region_size);
    const uint8_t *data = qs_port_dataset(&dataset_len);
    qs_agent_init(&g_agent, region, region_size, data, dataset_len);
    if (data != NULL && !g_agent.dataset_ok) {
        fprintf(stderr, "qs_board: %s is not a valid data set blob\n", dataset);
        return 2;
    }
    qs_agent_run(&g_agent);
    return 0;
}
