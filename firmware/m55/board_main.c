/*
 * The board agent on the Cortex-M55 of QEMU's mps3-an547: UART0 carries the protocol
 * (a pseudo-terminal on the host: -serial pty), the model lives in DDR, the data set is
 * placed in DDR by QEMU's loader device. Same core, same bits as the host build.
 */
#include "agent.h"
#include "port.h"

static qs_agent g_agent;

int main(void)
{
    size_t region_size = 0, dataset_len = 0;
    qs_port_init(0, NULL);
    uint8_t *region = qs_port_model_region(&region_size);
    const uint8_t *dataset = qs_port_dataset(&dataset_len);
    qs_agent_init(&g_agent, region, region_size, dataset, dataset_len);
    for (;;) {
        qs_agent_run(&g_agent); /* a UART never goes away: run again if it returns */
        g_agent.link_gone = 0;
    }
}
