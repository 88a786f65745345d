/*
 * shared.h - blocks shared with other processes and their deferred frees
 * (see shared.c). The IPC layer (src/ipc) adds references; cca_free asks
 * whether to defer; collections take what can be freed.
 */
#ifndef CCA_SHARED_H
#define CCA_SHARED_H

#include <stdatomic.h>

#include "internal.h"
#include "shmcount.h"

/* Blocks in the table: cca_free looks further only when it is not 0. */
extern CCA_HIDDEN _Atomic size_t shared_block_count;

/*
 * One more reference to the block at ptr (a live block of device): *ref gets
 * its counter. The block's interprocess event is recorded on stream and its
 * handle goes to *event_handle. Returns CCA_OK, CCA_ERR_OUT_OF_MEMORY, or
 * the backend's error (no reference taken).
 */
cca_status_t shared_add_reference(cca_backend_t *be, uintptr_t ptr, int device,
                                  cca_stream_t stream, shmcount_ref_t *ref,
                                  cca_ipc_handle_t *event_handle);
typedef enum shared_free {
    SHARED_FREE_NOW = 0,  /* not referenced elsewhere: free it */
    SHARED_FREE_DEFERRED, /* referenced by another process: the free is now deferred */
    SHARED_FREE_TWICE,    /* its free was deferred already: a double free */
} shared_free_t;

/* Whether another process maps the block at ptr (a free of it would be deferred, or was). */
bool shared_holds(uintptr_t ptr);
/* cca_free's question about the block at ptr (see shared_free_t). */
shared_free_t shared_on_free(uintptr_t ptr);
/*
 * Take up to cap blocks whose free was deferred and whose references are all
 * released: their pointers go to out, to be freed (cca_free) by the caller.
 */
size_t shared_take_collectable(uintptr_t *out, size_t cap);
/* Deferred frees still waiting for other processes. */
size_t shared_pending(void);
/* Destroy again the events whose destruction failed (empty_cache). */
void shared_retry_releases(void);
/* Forget every entry (device state shutdown: the blocks go with it). */
void shared_shutdown(void);

/* shared_on_free, at the cost of one relaxed load when nothing is shared. */
static inline shared_free_t shared_check_free(uintptr_t ptr)
{
    if (!atomic_load_explicit(&shared_block_count, memory_order_relaxed))
        return SHARED_FREE_NOW;
    return shared_on_free(ptr);
}

#endif /* CCA_SHARED_H */
