/*
 * qs_board: the C board agent on a POSIX host, serving the protocol on a serial device
 * (a pseudo-terminal in tests). The daemon cannot tell it from an STM32N6 board.
 *
 *   qs_board <serial device> [--dataset FILE.qzds] [--board-id ID]
 *   qs_board --pty LINK [--dataset FILE.qzds] [--board-id ID]
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

static int usage(void)
{
    fprintf(stderr, "usage: qs_board (<serial device> | --pty LINK) [--dataset FILE.qzds] [--board-id ID]\n");
    return 2;
}

int main(int argc, char **argv)
{
    const char *device = NULL, *pty_link = NULL, *dataset = NULL, *board_id = NULL;
    for (int i = 1; i < argc; ++i) {
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
    if ((device == NULL) == (pty_link == NULL) || (board_id != NULL && !board_id_ok(board_id))) {
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
