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

/* Owner side: take a fresh slot (its reference not held). CCA_OK, CCA_ERR_OUT_OF_MEMORY, CCA_ERR_BACKEND. */
cca_status_t shmcount_take(shmcount_ref_t *ref);
/*
 * Owner side: mark the slot's reference held (a handle made); whether it is
 * held; release it once (CCA_OK, or CCA_ERR_INVALID_ARGUMENT where it was
 * released already or the slot was given back: nothing is written); give the
 * slot back.
 */
void shmcount_hold(const shmcount_ref_t *ref);
bool shmcount_held(const shmcount_ref_t *ref);
cca_status_t shmcount_drop(const shmcount_ref_t *ref);
void shmcount_give_back(const shmcount_ref_t *ref);
/*
 * Another process: release the owner's reference, once. CCA_OK,
 * CCA_ERR_BACKEND (the owner's file cannot be reached: it exited),
 * CCA_ERR_OUT_OF_MEMORY, CCA_ERR_INVALID_ARGUMENT (released already, the slot
 * given back, a slot out of range, or the file ref names is not a counter
 * file: nothing is written).
 */
cca_status_t shmcount_release_foreign(const shmcount_ref_t *ref);
/*
 * Another process: CCA_OK if the owner's reference is held,
 * CCA_ERR_INVALID_ARGUMENT if not (released, or the block was freed), or the
 * errors above.
 */
cca_status_t shmcount_check_foreign(const shmcount_ref_t *ref);
/* Unmap other processes' files, and close own files with no slot taken. */
void shmcount_shutdown(void);

#endif /* CCA_SHMCOUNT_H */
