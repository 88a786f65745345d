/*
 * shared.c - blocks this process shared with others through IPC handles,
 * and PyTorch's rule that memory another process maps is not freed under
 * it (torch's CudaIPCSentData and its "limbo"): each handle made for a block
 * holds a reference of its own in shared memory (core/shmcount.c), which the
 * process that opens the handle releases when it closes it (or anyone, once,
 * with cca_ipc_release_handle). A cca_free of a block with a reference still
 * held is deferred: the block
 * stays allocated (so neither it nor its segment can be reused or given back
 * to the driver) until a collection (cca_ipc_collect, and the allocation slow
 * path, as PyTorch's "cuda_ipc_collect" free-memory callback; both in
 * alloc.c) takes it from here with every reference released and frees it.
 * Invariant: a block is in the table from its first handle until its free
 * completes; `pending` counts the entries whose free was deferred.
 */
#include <pthread.h>
#include <stdlib.h>

#include "shared.h"

#define SHARED_BUCKETS 256

typedef struct shared_block {
    uintptr_t ptr;
    shmcount_ref_t *refs;      /* one per handle made (malloc'd) */
    size_t ref_count, ref_cap;
    int device;
    cca_event_t event;         /* interprocess event: the sharing stream's work */
    bool freed;                /* cca_free was called: free when the counter is 0 */
    struct shared_block *next;
} shared_block_t;

static pthread_mutex_t shared_lock = PTHREAD_MUTEX_INITIALIZER;
static shared_block_t *buckets[SHARED_BUCKETS];
static size_t pending;
static cca_backend_t *backend;     /* of the blocks in the table */
/* Events whose destruction failed, destroyed again later (device in the low bits' list). */
typedef struct shared_orphan {
    int device;
    cca_event_t event;
    struct shared_orphan *next;
} shared_orphan_t;
static shared_orphan_t *orphans;
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

/* Whether a handle of b still holds its reference (lock held). */
static bool held_locked(const shared_block_t *b)
{
    for (size_t i = 0; i < b->ref_count; i++)
        if (shmcount_held(&b->refs[i]))
            return true;
    return false;
}

/* Destroy an event, or keep it to destroy later (lock held). */
static void event_release_locked(int device, cca_event_t event)
{
    if (backend->event_destroy(backend->ctx, device, event) == CCA_OK)
        return;
    shared_orphan_t *o = malloc(sizeof(*o));
    if (!o)
        return; /* no memory to remember it: nothing more can be done */
    o->device = device;
    o->event = event;
    o->next = orphans;
    orphans = o;
}

static void orphans_retry_locked(void)
{
    shared_orphan_t **link = &orphans;
    while (*link) {
        shared_orphan_t *o = *link;
        if (backend->event_destroy(backend->ctx, o->device, o->event) == CCA_OK) {
            *link = o->next;
            free(o);
        } else {
            link = &o->next;
        }
    }
}

cca_status_t shared_add_reference(cca_backend_t *be, uintptr_t ptr, int device,
                                  cca_stream_t stream, shmcount_ref_t *ref,
                                  cca_ipc_handle_t *event_handle)
{
    pthread_mutex_lock(&shared_lock);
    backend = be;
    cca_status_t st = CCA_OK;
    shared_block_t **link = find_locked(ptr);
    shared_block_t *b = *link;
    bool fresh = !b;
    if (fresh) {
        b = calloc(1, sizeof(*b));
        if (!b) {
            st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for IPC bookkeeping");
            goto out_unlock;
        }
        b->ptr = ptr;
        b->device = device;
        st = be->ipc_event_create(be->ctx, device, &b->event);
        if (st != CCA_OK)
            goto out_free;
    }
    if (b->ref_count == b->ref_cap) {
        size_t cap = b->ref_cap ? 2 * b->ref_cap : 4;
        shmcount_ref_t *refs = realloc(b->refs, cap * sizeof(*refs));
        if (!refs) {
            st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for IPC bookkeeping");
            goto out_fresh;
        }
        b->refs = refs;
        b->ref_cap = cap;
    }
    shmcount_ref_t taken;
    st = shmcount_take(&taken);
    if (st != CCA_OK)
        goto out_fresh;
    /* The consumer waits for what the stream has queued so far (PyTorch's IPC event). */
    st = be->event_record(be->ctx, device, b->event, stream);
    if (st == CCA_OK)
        st = be->ipc_event_get_handle(be->ctx, device, b->event, event_handle);
    if (st != CCA_OK)
        goto out_slot;
    if (fresh) {
        *link = b;
        atomic_fetch_add(&shared_block_count, 1);
    }
    shmcount_hold(&taken);
    b->refs[b->ref_count++] = taken;
    *ref = taken;
    goto out_unlock;
out_slot:
    shmcount_give_back(&taken);
out_fresh:
    if (!fresh)
        goto out_unlock;
    event_release_locked(device, b->event);
out_free:
    free(b->refs);
    free(b);
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
    for (size_t i = 0; i < b->ref_count; i++)
        shmcount_give_back(&b->refs[i]);
    event_release_locked(b->device, b->event);
    atomic_fetch_sub(&shared_block_count, 1);
    free(b->refs);
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
        if (held_locked(b)) {
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

bool shared_holds(uintptr_t ptr)
{
    if (!atomic_load_explicit(&shared_block_count, memory_order_relaxed))
        return false;
    pthread_mutex_lock(&shared_lock);
    shared_block_t *b = *find_locked(ptr);
    bool held = b && (b->freed || held_locked(b));
    pthread_mutex_unlock(&shared_lock);
    return held;
}

size_t shared_take_collectable(uintptr_t *out, size_t cap)
{
    size_t n = 0;
    pthread_mutex_lock(&shared_lock);
    if (orphans)
        orphans_retry_locked();
    for (size_t i = 0; i < SHARED_BUCKETS && n < cap; i++) {
        shared_block_t **link = &buckets[i];
        while (*link && n < cap) {
            if ((*link)->freed && !held_locked(*link)) {
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

void shared_retry_releases(void)
{
    pthread_mutex_lock(&shared_lock);
    if (orphans)
        orphans_retry_locked();
    pthread_mutex_unlock(&shared_lock);
}

void shared_shutdown(void)
{
    pthread_mutex_lock(&shared_lock);
    for (size_t i = 0; i < SHARED_BUCKETS; i++)
        while (buckets[i])
            remove_locked(&buckets[i]);
    if (orphans)
        orphans_retry_locked();
    while (orphans) { /* still failing: the backend goes next, forget them */
        shared_orphan_t *o = orphans;
        orphans = o->next;
        free(o);
    }
    backend = NULL;
    pthread_mutex_unlock(&shared_lock);
}
