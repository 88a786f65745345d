/*
 * shared.c - blocks this process shared with others through IPC handles,
 * and PyTorch's rule that memory another process maps is not freed under
 * it (torch's CudaIPCSentData and its "limbo"): each handle made for a block
 * adds one to the block's counter in shared memory (core/shmcount.c), and
 * the process that opens the handle subtracts it when it closes it. A
 * cca_free of a block whose counter is above zero is deferred: the block
 * stays allocated (so neither it nor its segment can be reused or given back
 * to the driver) until a collection (cca_ipc_collect, and the allocation slow
 * path, as PyTorch's "cuda_ipc_collect" free-memory callback; both in
 * alloc.c) takes it from here with its counter at zero and frees it.
 * Invariant: a block is in the table from its first handle until its free
 * completes; `pending` counts the entries whose free was deferred.
 */
#include <pthread.h>
#include <stdlib.h>

#include "shared.h"

#define SHARED_BUCKETS 256

typedef struct shared_block {
    uintptr_t ptr;
    shmcount_ref_t ref;        /* the block's counter */
    bool freed;                /* cca_free was called: free when the counter is 0 */
    struct shared_block *next;
} shared_block_t;

static pthread_mutex_t shared_lock = PTHREAD_MUTEX_INITIALIZER;
static shared_block_t *buckets[SHARED_BUCKETS];
static size_t pending;
_Atomic size_t shared_block_count;

static size_t bucket_of(uintptr_t p)
{
    uint64_t x = (uint64_t)p >> 9;
    x *= 0x9e3779b97f4a7c15ull;
    return (size_t)(x >> 56) % SHARED_BUCKETS;
}

static shared_block_t **find_locked(uintptr_t p)
{
    shared_block_t **link = &buckets[bucket_of(p)];
    while (*link && (*link)->ptr != p)
        link = &(*link)->next;
    return link;
}

cca_status_t shared_add_reference(uintptr_t ptr, shmcount_ref_t *ref)
{
    pthread_mutex_lock(&shared_lock);
    cca_status_t st = CCA_OK;
    shared_block_t **link = find_locked(ptr);
    shared_block_t *b = *link;
    if (!b) {
        b = calloc(1, sizeof(*b));
        if (!b) {
            st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for IPC bookkeeping");
            goto out_unlock;
        }
        st = shmcount_take(&b->ref);
        if (st != CCA_OK) {
            free(b);
            goto out_unlock;
        }
        b->ptr = ptr;
        *link = b;
        atomic_fetch_add(&shared_block_count, 1);
    }
    shmcount_add(&b->ref, 1);
    *ref = b->ref;
out_unlock:
    pthread_mutex_unlock(&shared_lock);
    return st;
}

/* Drop an entry (lock held, *link the entry). */
static void remove_locked(shared_block_t **link)
{
    shared_block_t *b = *link;
    *link = b->next;
    if (b->freed)
        pending--;
    shmcount_give_back(&b->ref);
    atomic_fetch_sub(&shared_block_count, 1);
    free(b);
}

shared_free_t shared_on_free(uintptr_t ptr)
{
    pthread_mutex_lock(&shared_lock);
    shared_free_t what = SHARED_FREE_NOW;
    shared_block_t **link = find_locked(ptr);
    shared_block_t *b = *link;
    if (b && b->freed) {
        what = SHARED_FREE_TWICE;
    } else if (b) {
        if (shmcount_read(&b->ref) > 0) {
            b->freed = true;
            pending++;
            what = SHARED_FREE_DEFERRED;
        } else {
            remove_locked(link);
        }
    }
    pthread_mutex_unlock(&shared_lock);
    return what;
}

size_t shared_take_collectable(uintptr_t *out, size_t cap)
{
    size_t n = 0;
    pthread_mutex_lock(&shared_lock);
    for (size_t i = 0; i < SHARED_BUCKETS && n < cap; i++) {
        shared_block_t **link = &buckets[i];
        while (*link && n < cap) {
            if ((*link)->freed && shmcount_read(&(*link)->ref) <= 0) {
                out[n++] = (*link)->ptr;
                remove_locked(link);
            } else {
                link = &(*link)->next;
            }
        }
    }
    pthread_mutex_unlock(&shared_lock);
    return n;
}

size_t shared_pending(void)
{
    pthread_mutex_lock(&shared_lock);
    size_t n = pending;
    pthread_mutex_unlock(&shared_lock);
    return n;
}

void shared_shutdown(void)
{
    pthread_mutex_lock(&shared_lock);
    for (size_t i = 0; i < SHARED_BUCKETS; i++)
        while (buckets[i])
            remove_locked(&buckets[i]);
    pthread_mutex_unlock(&shared_lock);
}
