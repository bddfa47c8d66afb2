/* Host-only set-up of the POSIX port layer, called by main before qs_port_init. */
#ifndef QS_PORT_HOST_H
#define QS_PORT_HOST_H

/* Open the serial device — or, with pty_link, allocate a pseudo-terminal and link its
 * slave side there — read the data set blob (may be NULL), set the board id (may be
 * NULL). Returns 0 and prints why on failure. */
int qs_host_configure(const char *device, const char *pty_link, const char *dataset_path, const char *board_id);

#endif
