/*
 * ipc.h - the consumer side of IPC (see ipc.c), for the runtime and tests.
 */
#ifndef CCA_IPC_H
#define CCA_IPC_H

#include "internal.h"

/* Blocks of other processes open here. */
size_t ipc_open_count(void);
/* Close every open block (cca_shutdown, before the device state goes). */
void ipc_shutdown(void);

#endif /* CCA_IPC_H */
