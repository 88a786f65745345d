/*
 * shmcount.h - reference counters shared between processes (see shmcount.c).
 */
#ifndef CCA_SHMCOUNT_H
#define CCA_SHMCOUNT_H

#include <stdatomic.h>

#include "internal.h"

#define SHMCOUNT_SLOTS 4096 /* counters per file */

/* Where a counter lives: its owner process, file and slot, and the slot's serial. */
typedef struct shmcount_ref {
    int32_t pid;
    int32_t fd;
    uint32_t slot;
    uint64_t serial;
} shmcount_ref_t;

/* Owner side: take a fresh slot (count 0). CCA_OK, CCA_ERR_OUT_OF_MEMORY, CCA_ERR_BACKEND. */
cca_status_t shmcount_take(shmcount_ref_t *ref);
/* Owner side: add delta to a slot's count; read it; give the slot back. */
void shmcount_add(const shmcount_ref_t *ref, int64_t delta);
int64_t shmcount_read(const shmcount_ref_t *ref);
void shmcount_give_back(const shmcount_ref_t *ref);
/*
 * Another process: decrement the owner's counter (ignored when the slot was
 * reused). CCA_OK, CCA_ERR_BACKEND (the owner's file cannot be reached: it
 * exited), CCA_ERR_OUT_OF_MEMORY, CCA_ERR_INVALID_ARGUMENT (a slot out of
 * range, or the file ref names is not a counter file: nothing is written).
 */
cca_status_t shmcount_release_foreign(const shmcount_ref_t *ref);
/*
 * Another process: CCA_OK if the owner's counter is live and above zero,
 * CCA_ERR_INVALID_ARGUMENT if not (the block was freed), or the errors above.
 */
cca_status_t shmcount_check_foreign(const shmcount_ref_t *ref);
/*
 * Another process: CCA_OK if the file ref names is a counter file (its slot
 * is not looked at), or the errors of shmcount_release_foreign.
 */
cca_status_t shmcount_verify_foreign(const shmcount_ref_t *ref);
/* Unmap other processes' files, and close own files with no slot taken. */
void shmcount_shutdown(void);

#endif /* CCA_SHMCOUNT_H */
