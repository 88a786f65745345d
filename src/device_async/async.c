/*
 * async.c - `backend:cudaMallocAsync`: every allocation is a stream-ordered
 * allocation from the device's default memory pool (cudaMallocAsync), every
 * free a cudaFreeAsync, with PyTorch 2.11's semantics for this backend:
 *  - each device's pool is set up on first use: release threshold UINT64_MAX
 *    (the pool keeps what it reserved across synchronisations), the three
 *    reuse policies on, and a "unifying" stream of cca's own;
 *  - record_stream remembers the extra (stream, device) pairs; the free then
 *    makes the unifying stream wait for the allocation stream and each of
 *    them (an event each) and frees in the unifying stream;
 *  - a memory fraction is a hard limit on the bytes allocated through cca;
 *  - empty_cache synchronises each set-up device and trims its pool to 0;
 *  - statistics are what the pool reports: allocated and active bytes are the
 *    pool's used memory, reserved bytes its reserved memory (current and
 *    high-water mark); every other statistic stays 0, resetting accumulated
 *    statistics has no effect (warned once), resetting peaks resets the
 *    pool's high-water marks;
 *  - cache_info's largest block is found by trial allocations, halving;
 *  - graph capture (begin/end of allocating to a private pool): one capture at
 *    a time in the process, pool ids and filters ignored; allocations while
 *    it is underway are marked captured (on a capturing stream the driver
 *    makes them nodes of the graph); a free of an uncaptured allocation while
 *    it is underway is deferred (warned once) until the first allocation
 *    after it ends; every stream a free was queued on during it is joined
 *    back into the capture stream at its end; an uncaptured free of a
 *    captured allocation is allowed, with a warning. Private pools
 *    themselves (MemPool, use counts, checkpoints) give PyTorch's errors.
 * Invariant: an allocation is in the table exactly from its malloc_async to
 * its free_async (a deferred free included), and used_bytes of its device
 * counts its size meanwhile.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "async.h"
#include "stats_text.h"

#define ASYNC_SHARDS 64

typedef struct async_use {
    cca_stream_t stream;
    int device;
} async_use_t;

typedef struct async_entry {
    uintptr_t ptr;
    size_t size;                 /* bytes requested */
    int device;
    bool captured;               /* allocated while a capture was underway */
    bool deferred;               /* freed during a capture, freed for real after it */
    cca_stream_t stream;         /* allocation stream */
    async_use_t *uses;           /* streams added by record_stream */
    uint32_t use_count, use_cap;
    struct async_entry *next;    /* chain in its shard */
} async_entry_t;

typedef struct async_shard {
    pthread_mutex_t lock;
    async_entry_t **buckets;     /* power-of-two table of chains */
    size_t cap, count;
} async_shard_t;

/* A backend resource whose release failed, released again later. */
typedef struct async_orphan {
    bool is_event;               /* an event, else a malloc_async pointer */
    void *handle;
    struct async_orphan *next;
} async_orphan_t;

typedef struct async_device {
    pthread_mutex_t lock;        /* set-up, the orphans */
    pthread_rwlock_t pool_lock;  /* read: calls that change the pool; write: reading its
                                    statistics, so they are one consistent picture */
    size_t total_memory;         /* bytes, the device allocator's figure (async_init) */
    atomic_bool ready;           /* pool configured, unifying stream made */
    cca_stream_t unifying;       /* frees of blocks used on several streams */
    _Atomic size_t used_bytes;   /* allocated through cca (PyTorch's pytorch_used_bytes) */
    _Atomic size_t limit;        /* bytes; SIZE_MAX: no memory fraction */
    _Atomic size_t pending;      /* bytes of the charges being counted or whose driver call
                                    has not returned (charge) */
    _Atomic size_t released;     /* charges whose bytes left pending so far (charge) */
    _Atomic size_t in_flight;    /* charges that fit whose driver call is under way (charge) */
    async_orphan_t *orphans;     /* releases to retry (lock) */
} async_device_t;

/* Graph capture (PyTorch's capture_underway and its lists), under its own lock. */
typedef struct async_capture {
    pthread_mutex_t lock;
    atomic_bool active;          /* capture underway, or deferred frees waiting (fast check) */
    atomic_size_t fast_calls;    /* allocations and frees on the path without this lock */
    bool underway;               /* between begin and end */
    int device;                  /* the capture's device and stream (the rejoin target) */
    cca_stream_t stream;
    async_use_t *free_streams;   /* streams frees were queued on during the capture (a set) */
    size_t free_stream_count, free_stream_cap;
    uintptr_t *deferred;         /* uncaptured allocations freed during the capture */
    size_t deferred_count, deferred_cap;
    bool warned_deferred;        /* the deferred free's warning is given once */
} async_capture_t;

typedef struct async_state {
    cca_backend_t *backend;      /* the allocator's backend (async_init) */
    int device_count;
    async_device_t *devices;
    async_shard_t shards[ASYNC_SHARDS];
    async_capture_t capture;
    atomic_bool warned_reset;    /* reset_accumulated_stats warning given */
} async_state_t;

static async_state_t *AS;
async_state_t *async_active; /* AS, for async_enabled */

/* ---- the pointer table ---------------------------------------------------------------- */

static inline uint64_t ptr_hash(uintptr_t p)
{
    uint64_t x = (uint64_t)p >> 8;
    x *= 0x9e3779b97f4a7c15ull;
    return x ^ (x >> 31);
}

static async_shard_t *shard_of(uintptr_t p)
{
    return &AS->shards[ptr_hash(p) % ASYNC_SHARDS];
}

/* Link e into its chain (shard lock held, the table allocated); never allocates. */
static void table_link_locked(async_shard_t *sh, async_entry_t *e)
{
    size_t j = (ptr_hash(e->ptr) >> 6) & (sh->cap - 1);
    e->next = sh->buckets[j];
    sh->buckets[j] = e;
    sh->count++;
}

/* Insert e (its shard's lock held). Returns false when out of host memory. */
static bool table_insert_locked(async_shard_t *sh, async_entry_t *e)
{
    if (sh->count + 1 > sh->cap / 2) {
        size_t cap = sh->cap ? sh->cap * 2 : 64;
        async_entry_t **b = calloc(cap, sizeof(*b));
        if (!b)
            return false;
        for (size_t i = 0; i < sh->cap; i++) {
            async_entry_t *x = sh->buckets[i];
            while (x) {
                async_entry_t *n = x->next;
                size_t j = (ptr_hash(x->ptr) >> 6) & (cap - 1);
                x->next = b[j];
                b[j] = x;
                x = n;
            }
        }
        free(sh->buckets);
        sh->buckets = b;
        sh->cap = cap;
    }
    table_link_locked(sh, e);
    return true;
}

/* Find the entry of p, unlinking it when remove is set (shard lock held). */
static async_entry_t *table_find_locked(async_shard_t *sh, uintptr_t p, bool remove)
{
    if (!sh->cap)
        return NULL;
    async_entry_t **link = &sh->buckets[(ptr_hash(p) >> 6) & (sh->cap - 1)];
    for (; *link; link = &(*link)->next) {
        async_entry_t *e = *link;
        if (e->ptr != p)
            continue;
        if (remove) {
            *link = e->next;
            sh->count--;
        }
        return e;
    }
    return NULL;
}

static void entry_free(async_entry_t *e)
{
    free(e->uses);
    free(e);
}

size_t async_live_count(void)
{
    if (!AS)
        return 0;
    size_t n = 0;
    for (int i = 0; i < ASYNC_SHARDS; i++) {
        pthread_mutex_lock(&AS->shards[i].lock);
        n += AS->shards[i].count;
        pthread_mutex_unlock(&AS->shards[i].lock);
    }
    return n;
}

/* ---- releases that failed ------------------------------------------------------------------ */

/*
 * Keep a resource whose release failed, to release it at the next
 * empty_cache or at shutdown, so a failing backend call leaks nothing.
 */
static void orphan_add(int device, bool is_event, void *handle)
{
    async_orphan_t *o = malloc(sizeof(*o));
    if (!o)
        return; /* no host memory to remember it: nothing more can be done */
    async_device_t *ad = &AS->devices[device];
    o->is_event = is_event;
    o->handle = handle;
    pthread_mutex_lock(&ad->lock);
    o->next = ad->orphans;
    ad->orphans = o;
    pthread_mutex_unlock(&ad->lock);
}

/* Release the device's orphans again; those that fail stay. Returns the first error. */
static cca_status_t orphans_retry(cca_backend_t *be, int device)
{
    async_device_t *ad = &AS->devices[device];
    cca_status_t result = CCA_OK;
    pthread_mutex_lock(&ad->lock);
    async_orphan_t **link = &ad->orphans;
    while (*link) {
        async_orphan_t *o = *link;
        cca_status_t st = o->is_event ? be->event_destroy(be->ctx, device, o->handle)
                                      : be->free_async(be->ctx, device, o->handle, NULL);
        if (st == CCA_OK) {
            *link = o->next;
            free(o);
        } else {
            if (result == CCA_OK)
                result = st;
            link = &o->next;
        }
    }
    pthread_mutex_unlock(&ad->lock);
    return result;
}

/* ---- set-up ------------------------------------------------------------------------------ */

cca_status_t async_init(cca_backend_t *backend, int device_count, const size_t *total_memory,
                        double fraction)
{
    async_state_t *s = calloc(1, sizeof(*s));
    if (!s)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory initialising cudaMallocAsync");
    s->devices = calloc((size_t)device_count, sizeof(*s->devices));
    if (!s->devices) {
        free(s);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory initialising cudaMallocAsync");
    }
    s->backend = backend;
    s->device_count = device_count;
    for (int d = 0; d < device_count; d++) {
        pthread_mutex_init(&s->devices[d].lock, NULL);
        pthread_rwlock_init(&s->devices[d].pool_lock, NULL);
        size_t limit = SIZE_MAX;
        if (fraction > 0.0)
            limit = (size_t)(fraction * (double)total_memory[d]);
        s->devices[d].total_memory = total_memory[d];
        atomic_init(&s->devices[d].limit, limit);
    }
    for (int i = 0; i < ASYNC_SHARDS; i++)
        pthread_mutex_init(&s->shards[i].lock, NULL);
    pthread_mutex_init(&s->capture.lock, NULL);
    AS = s;
    async_active = s;
    return CCA_OK;
}

/*
 * Configure device's pool and make its unifying stream, once (PyTorch's
 * lazy_init_device). On failure nothing is left half made but pool attributes.
 */
static cca_status_t device_ready(int device)
{
    async_device_t *ad = &AS->devices[device];
    if (atomic_load_explicit(&ad->ready, memory_order_acquire))
        return CCA_OK;
    cca_backend_t *be = AS->backend;
    cca_status_t st = CCA_OK;
    pthread_mutex_lock(&ad->lock);
    if (atomic_load_explicit(&ad->ready, memory_order_relaxed))
        goto out_unlock;
    st = be->mempool_set_attr(be->ctx, device, CCA_MEMPOOL_RELEASE_THRESHOLD, UINT64_MAX);
    if (st == CCA_OK)
        st = be->mempool_set_attr(be->ctx, device, CCA_MEMPOOL_REUSE_FOLLOW_EVENT_DEPENDENCIES, 1);
    if (st == CCA_OK)
        st = be->mempool_set_attr(be->ctx, device, CCA_MEMPOOL_REUSE_ALLOW_OPPORTUNISTIC, 1);
    if (st == CCA_OK)
        st = be->mempool_set_attr(be->ctx, device, CCA_MEMPOOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES, 1);
    if (st == CCA_OK)
        st = be->stream_create(be->ctx, device, &ad->unifying);
    if (st == CCA_OK)
        atomic_store_explicit(&ad->ready, true, memory_order_release);
out_unlock:
    pthread_mutex_unlock(&ad->lock);
    return st;
}

void async_shutdown(cca_backend_t *be)
{
    async_state_t *s = AS;
    if (!s)
        return;
    /* Work on the allocations may still be queued, and their streams may be
     * gone: wait for every device, then free in the default stream. */
    for (int d = 0; d < s->device_count; d++)
        if (atomic_load(&s->devices[d].ready))
            (void)be->device_synchronize(be->ctx, d);
    for (int i = 0; i < ASYNC_SHARDS; i++) {
        async_shard_t *sh = &s->shards[i];
        for (size_t j = 0; j < sh->cap; j++) {
            async_entry_t *e = sh->buckets[j];
            while (e) {
                async_entry_t *n = e->next;
                (void)be->free_async(be->ctx, e->device, (void *)e->ptr, NULL);
                entry_free(e);
                e = n;
            }
        }
        free(sh->buckets);
        pthread_mutex_destroy(&sh->lock);
    }
    for (int d = 0; d < s->device_count; d++) {
        async_device_t *ad = &s->devices[d];
        (void)orphans_retry(be, d);
        while (ad->orphans) { /* still failing: forget them */
            async_orphan_t *o = ad->orphans;
            ad->orphans = o->next;
            free(o);
        }
        if (atomic_load(&ad->ready)) {
            (void)be->device_synchronize(be->ctx, d);
            (void)be->stream_destroy(be->ctx, d, ad->unifying);
        }
        pthread_mutex_destroy(&ad->lock);
        pthread_rwlock_destroy(&ad->pool_lock);
    }
    free(s->capture.free_streams);
    free(s->capture.deferred);
    pthread_mutex_destroy(&s->capture.lock);
    free(s->devices);
    free(s);
    AS = NULL;
    async_active = NULL;
}

/* ---- allocation ---------------------------------------------------------------------------- */

static void capture_flush_locked(void);
static cca_status_t capture_free(void *ptr);
static cca_status_t free_and_forget(async_shard_t *sh, async_entry_t *e);

/*
 * The path of allocations and frees while no capture is underway and no free
 * is deferred: no lock of the capture's. A capture's begin waits until the
 * calls already on it are done (their driver calls come before the capture
 * begins, as under PyTorch's mutex); later calls see the capture and take
 * its lock. Returns false when the call must take the capture's path.
 */
static inline bool fast_enter(void)
{
    async_capture_t *cap = &AS->capture;
    atomic_fetch_add(&cap->fast_calls, 1); /* sequentially consistent with begin's store */
    if (!atomic_load(&cap->active))
        return true;
    atomic_fetch_sub_explicit(&cap->fast_calls, 1, memory_order_release);
    return false;
}

static inline void fast_leave(void)
{
    atomic_fetch_sub_explicit(&AS->capture.fast_calls, 1, memory_order_release);
}

/* PyTorch's out-of-memory message of this backend. */
static cca_status_t async_oom(int device, size_t size)
{
    cca_backend_t *be = AS->backend;
    async_device_t *ad = &AS->devices[device];
    size_t device_free = 0, device_total = 0;
    cca_status_t st = be->mem_get_info(be->ctx, device, &device_free, &device_total);
    if (st != CCA_OK)
        return st;
    char used[32], req[32], total[32], freeb[32], limit[32];
    stats_format_size(atomic_load(&ad->used_bytes), used, sizeof(used));
    stats_format_size(size, req, sizeof(req));
    stats_format_size(device_total, total, sizeof(total));
    stats_format_size(device_free, freeb, sizeof(freeb));
    stats_format_size(atomic_load(&ad->limit), limit, sizeof(limit));
    return cca_raise(CCA_ERR_OUT_OF_MEMORY,
                     "Allocation on device %d would exceed allowed memory. (out of memory)\n"
                     "Currently allocated     : %s\n"
                     "Requested               : %s\n"
                     "Device limit            : %s\n"
                     "Free (according to CUDA): %s\n"
                     "PyTorch limit (set by user-supplied memory fraction)\n"
                     "                        : %s",
                     device, used, req, total, freeb, limit);
}

/*
 * Count size bytes against the device's limit; false when they do not fit. On
 * true the caller makes its driver call, then charge_done (and gives the bytes
 * back if the call failed). PyTorch checks the limit under its mutex, one
 * allocation at a time, and counts the bytes once the driver has them: a
 * request that does not fit only because another thread's bytes are counted
 * while its driver call is under way (and may yet fail) waits for that call,
 * however long it takes, and counts again when one has returned meanwhile; one
 * that the bytes already allocated leave no room for is refused at once.
 */
static _Atomic size_t charge_waits; /* tests: charges that waited for another's driver call */

size_t async_test_charge_waits(void)
{
    return atomic_load(&charge_waits);
}

static bool charge(async_device_t *ad, size_t size)
{
    for (unsigned spins = 0;; spins++) {
        size_t released = atomic_load_explicit(&ad->released, memory_order_seq_cst);
        atomic_fetch_add_explicit(&ad->pending, size, memory_order_seq_cst);
        size_t before = atomic_fetch_add_explicit(&ad->used_bytes, size, memory_order_seq_cst);
        size_t limit = atomic_load_explicit(&ad->limit, memory_order_relaxed);
        if (before + size >= before && before + size <= limit) {
            atomic_fetch_add_explicit(&ad->in_flight, 1, memory_order_seq_cst);
            return true;
        }
        atomic_fetch_sub_explicit(&ad->used_bytes, size, memory_order_seq_cst);
        /* The other charges' bytes, and whether a driver call is under way: while none has
         * left since this count, every byte of theirs it saw is among them, and a call it saw
         * is (a charge's bytes enter pending before used_bytes; they leave used_bytes, then
         * bump released, before they leave pending and the call leaves in_flight). */
        size_t others = atomic_load_explicit(&ad->pending, memory_order_seq_cst) - size;
        bool no_call = !atomic_load_explicit(&ad->in_flight, memory_order_seq_cst);
        bool recount = atomic_load_explicit(&ad->released, memory_order_seq_cst) != released;
        atomic_fetch_add_explicit(&ad->released, 1, memory_order_seq_cst);
        atomic_fetch_sub_explicit(&ad->pending, size, memory_order_seq_cst);
        /* One that left since may have given back bytes it saw: count again. Otherwise the
         * bytes allocated already leave no room, or a driver call under way is waited for
         * however long it takes, as PyTorch's mutex would; others that only fail too keep
         * trying a while, then give up. */
        if (!recount) {
            size_t allocated = before > others ? before - others : 0;
            if (allocated + size < allocated || allocated + size > limit)
                return false;
            if (spins >= 4096 && no_call)
                return false;
        }
        if (!spins)
            atomic_fetch_add(&charge_waits, 1);
        cca_spin_backoff(spins);
    }
}

/* The driver call after a charge of size bytes has returned (its bytes given back already if
 * the call failed). */
static void charge_done(async_device_t *ad, size_t size)
{
    /* released first: a count that sees the bytes or the call gone sees released moved */
    atomic_fetch_add_explicit(&ad->released, 1, memory_order_seq_cst);
    atomic_fetch_sub_explicit(&ad->pending, size, memory_order_seq_cst);
    atomic_fetch_sub_explicit(&ad->in_flight, 1, memory_order_seq_cst);
}

/* The allocation itself; captured: a capture is underway (the caller knows). */
static cca_status_t malloc_entry(int device, size_t size, cca_stream_t stream, bool captured,
                                 void **ptr)
{
    cca_backend_t *be = AS->backend;
    async_device_t *ad = &AS->devices[device];
    cca_status_t st = device_ready(device);
    if (st != CCA_OK)
        return st;
    async_entry_t *e = calloc(1, sizeof(*e));
    if (!e)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for allocator bookkeeping");
    if (!charge(ad, size)) {
        free(e);
        return async_oom(device, size);
    }
    void *p = NULL;
    pthread_rwlock_rdlock(&ad->pool_lock);
    st = be->malloc_async(be->ctx, device, size, stream, &p);
    pthread_rwlock_unlock(&ad->pool_lock);
    if (st != CCA_OK)
        atomic_fetch_sub_explicit(&ad->used_bytes, size, memory_order_seq_cst);
    charge_done(ad, size);
    if (st != CCA_OK) {
        free(e);
        return st == CCA_ERR_OUT_OF_MEMORY ? async_oom(device, size) : st;
    }
    e->ptr = (uintptr_t)p;
    e->size = size;
    e->device = device;
    e->captured = captured;
    e->stream = stream;
    async_shard_t *sh = shard_of(e->ptr);
    pthread_mutex_lock(&sh->lock);
    bool ok = table_insert_locked(sh, e);
    pthread_mutex_unlock(&sh->lock);
    if (!ok) {
        (void)be->free_async(be->ctx, device, p, stream);
        atomic_fetch_sub_explicit(&ad->used_bytes, size, memory_order_relaxed);
        free(e);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for allocator bookkeeping");
    }
    *ptr = p;
    return CCA_OK;
}

cca_status_t async_malloc(int device, size_t size, cca_stream_t stream, void **ptr)
{
    if (fast_enter()) {
        cca_status_t st = malloc_entry(device, size, stream, false, ptr);
        fast_leave();
        return st;
    }
    /* a capture underway or frees deferred: one at a time with the capture's changes, as
     * PyTorch's mallocAsync under its mutex */
    async_capture_t *cap = &AS->capture;
    pthread_mutex_lock(&cap->lock);
    capture_flush_locked();
    cca_status_t st = malloc_entry(device, size, stream, cap->underway, ptr);
    pthread_mutex_unlock(&cap->lock);
    return st;
}

/* Make `dependent` wait for the work queued so far on (stream, device). */
static cca_status_t sync_streams(int device, cca_stream_t stream, int dependent_device,
                                 cca_stream_t dependent)
{
    cca_backend_t *be = AS->backend;
    cca_event_t ev = NULL;
    cca_status_t st = be->event_create(be->ctx, device, &ev);
    if (st != CCA_OK)
        return st;
    st = be->event_record(be->ctx, device, ev, stream);
    if (st == CCA_OK)
        st = be->stream_wait_event(be->ctx, dependent_device, dependent, ev);
    /* The wait is queued: the event may go now; if it cannot, later. */
    cca_status_t dst = be->event_destroy(be->ctx, device, ev);
    if (dst != CCA_OK)
        orphan_add(device, true, ev);
    return st;
}

/* cudaFreeAsync of e, through the unifying stream when it was used on others. */
static cca_status_t free_entry(async_entry_t *e)
{
    cca_backend_t *be = AS->backend;
    if (!e->use_count)
        return be->free_async(be->ctx, e->device, (void *)e->ptr, e->stream);
    cca_stream_t unifying = AS->devices[e->device].unifying;
    cca_status_t st = sync_streams(e->device, e->stream, e->device, unifying);
    for (uint32_t i = 0; st == CCA_OK && i < e->use_count; i++)
        st = sync_streams(e->uses[i].device, e->uses[i].stream, e->device, unifying);
    if (st == CCA_OK)
        st = be->free_async(be->ctx, e->device, (void *)e->ptr, unifying);
    return st;
}

static cca_status_t not_allocated(void *ptr)
{
    return cca_raise(CCA_ERR_INVALID_POINTER,
                     "cca_free: pointer %p was not allocated by cca, or was already freed", ptr);
}

/* PyTorch's warning for a free, outside any capture, of what a capture allocated. */
static void warn_captured_free(const async_entry_t *e)
{
    cca_outputf("cca warning: Attempting uncaptured free of a captured allocation with address "
               "%p\nThis is technically allowed, but may indicate you are losing the last "
               "user-visible tensor through which the allocation can be accessed, so you'll have "
               "no way to view the data after future replays of the owning graph.\n",
               (void *)e->ptr);
}

cca_status_t async_free(void *ptr)
{
    if (!fast_enter())
        return capture_free(ptr);
    uintptr_t p = (uintptr_t)ptr;
    async_shard_t *sh = shard_of(p);
    pthread_mutex_lock(&sh->lock);
    async_entry_t *e = table_find_locked(sh, p, true);
    pthread_mutex_unlock(&sh->lock);
    cca_status_t st;
    if (!e) {
        st = not_allocated(ptr);
    } else {
        if (e->captured)
            warn_captured_free(e);
        st = free_and_forget(sh, e);
    }
    fast_leave();
    return st;
}

/* free_entry of e (out of its table) under the pool's read lock; put back if it fails. */
static cca_status_t free_and_forget(async_shard_t *sh, async_entry_t *e)
{
    async_device_t *ad = &AS->devices[e->device];
    pthread_rwlock_rdlock(&ad->pool_lock);
    cca_status_t st = free_entry(e);
    pthread_rwlock_unlock(&ad->pool_lock);
    if (st != CCA_OK) {
        /* Still allocated: the caller may retry. Its chain slot needs no memory. */
        pthread_mutex_lock(&sh->lock);
        table_link_locked(sh, e);
        pthread_mutex_unlock(&sh->lock);
        return st;
    }
    atomic_fetch_sub_explicit(&ad->used_bytes, e->size, memory_order_relaxed);
    entry_free(e);
    return CCA_OK;
}

cca_status_t async_record_stream(void *ptr, cca_stream_t stream)
{
    cca_backend_t *be = AS->backend;
    int device = 0;
    cca_status_t st = be->get_device(be->ctx, &device); /* the stream's device */
    if (st != CCA_OK)
        return st;
    uintptr_t p = (uintptr_t)ptr;
    async_shard_t *sh = shard_of(p);
    pthread_mutex_lock(&sh->lock);
    async_entry_t *e = table_find_locked(sh, p, false);
    if (!e) {
        pthread_mutex_unlock(&sh->lock);
        return cca_raise(CCA_ERR_INVALID_POINTER,
                         "cca_record_stream: pointer %p was not allocated by cca, or was already freed",
                         ptr);
    }
    if (stream == e->stream && device == e->device) { /* the allocation stream: nothing to do */
        static atomic_bool warned; /* PyTorch's warning, once */
        if (!atomic_exchange(&warned, true))
            cca_output("cca warning: Called record_stream on tensor whose original creation "
                       "stream matches the recorded stream. This is unnecessary and has no "
                       "effect.\n");
        goto out_unlock;
    }
    for (uint32_t i = 0; i < e->use_count; i++)
        if (e->uses[i].stream == stream && e->uses[i].device == device)
            goto out_unlock;
    if (e->use_count == e->use_cap) {
        uint32_t cap = e->use_cap ? e->use_cap * 2 : 2;
        async_use_t *uses = realloc(e->uses, cap * sizeof(*uses));
        if (!uses) {
            st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory in cca_record_stream");
            goto out_unlock;
        }
        e->uses = uses;
        e->use_cap = cap;
    }
    e->uses[e->use_count++] = (async_use_t){stream, device};
out_unlock:
    pthread_mutex_unlock(&sh->lock);
    return st;
}

/* ---- cache control and queries -------------------------------------------------------------- */

cca_status_t async_empty_cache(void)
{
    cca_backend_t *be = AS->backend;
    cca_status_t result = CCA_OK;
    for (int d = 0; d < AS->device_count; d++) {
        if (!atomic_load_explicit(&AS->devices[d].ready, memory_order_acquire)) {
            /* no pool to trim, but a stream event of it may wait for its release (a
             * record_stream made with it current) */
            cca_status_t st = orphans_retry(be, d);
            if (st != CCA_OK && result == CCA_OK)
                result = st;
            continue;
        }
        pthread_rwlock_rdlock(&AS->devices[d].pool_lock);
        cca_status_t st = orphans_retry(be, d);
        if (st == CCA_OK)
            st = be->device_synchronize(be->ctx, d);
        if (st == CCA_OK)
            st = be->mempool_trim(be->ctx, d, 0);
        pthread_rwlock_unlock(&AS->devices[d].pool_lock);
        if (st != CCA_OK && result == CCA_OK)
            result = st;
    }
    return result;
}

cca_status_t async_cache_info(int device, size_t *total_cached, size_t *largest_block)
{
    cca_backend_t *be = AS->backend;
    async_device_t *ad = &AS->devices[device];
    cca_status_t st = device_ready(device);
    if (st != CCA_OK)
        return st;
    size_t free_bytes = 0, total = 0;
    st = be->mem_get_info(be->ctx, device, &free_bytes, &total);
    if (st != CCA_OK)
        return st;
    size_t used = atomic_load(&ad->used_bytes);
    size_t limit = atomic_load(&ad->limit);
    size_t headroom = limit > used ? limit - used : 0;
    size_t guess = free_bytes < headroom ? free_bytes : headroom;
    /* As PyTorch: the largest workspace found by trial, halving on failure, with every other
     * allocation of the device held off meanwhile (PyTorch holds its mutex): one made between
     * the trial's allocation and its free would find the pool grown to the whole device */
    pthread_rwlock_wrlock(&ad->pool_lock);
    while (guess > 0) {
        void *p = NULL;
        st = be->malloc_async(be->ctx, device, guess, NULL, &p);
        if (st == CCA_OK) {
            if (be->free_async(be->ctx, device, p, NULL) != CCA_OK)
                orphan_add(device, false, p); /* the guess stands; the trial goes later */
            break;
        }
        if (st != CCA_ERR_OUT_OF_MEMORY)
            break;
        st = CCA_OK;
        guess >>= 1;
    }
    pthread_rwlock_unlock(&ad->pool_lock);
    if (st != CCA_OK)
        return st;
    uint64_t reserved = 0, in_use = 0;
    st = be->mempool_get_attr(be->ctx, device, CCA_MEMPOOL_RESERVED_CURRENT, &reserved);
    if (st == CCA_OK)
        st = be->mempool_get_attr(be->ctx, device, CCA_MEMPOOL_USED_CURRENT, &in_use);
    if (st != CCA_OK)
        return st;
    if (total_cached)
        *total_cached = reserved > in_use ? (size_t)(reserved - in_use) : 0;
    if (largest_block)
        *largest_block = guess;
    cca_clear_error();
    return CCA_OK;
}

cca_status_t async_cached_bytes(int device, size_t *cached)
{
    cca_backend_t *be = AS->backend;
    async_device_t *ad = &AS->devices[device];
    uint64_t reserved = 0, in_use = 0;
    if (atomic_load_explicit(&ad->ready, memory_order_acquire)) {
        pthread_rwlock_wrlock(&ad->pool_lock); /* one consistent picture */
        cca_status_t st =
            be->mempool_get_attr(be->ctx, device, CCA_MEMPOOL_RESERVED_CURRENT, &reserved);
        if (st == CCA_OK)
            st = be->mempool_get_attr(be->ctx, device, CCA_MEMPOOL_USED_CURRENT, &in_use);
        pthread_rwlock_unlock(&ad->pool_lock);
        if (st != CCA_OK)
            return st;
    }
    *cached = reserved > in_use ? (size_t)(reserved - in_use) : 0;
    return CCA_OK;
}

cca_status_t async_get_base_allocation(void *ptr, void **base, size_t *size)
{
    uintptr_t p = (uintptr_t)ptr;
    async_shard_t *sh = shard_of(p);
    pthread_mutex_lock(&sh->lock);
    async_entry_t *e = table_find_locked(sh, p, false);
    size_t n = e ? e->size : 0;
    pthread_mutex_unlock(&sh->lock);
    if (!e)
        return cca_raise(CCA_ERR_INVALID_POINTER,
                         "cca_get_base_allocation: pointer %p is not an allocation of the "
                         "cudaMallocAsync backend (which knows allocations by their start only)",
                         ptr);
    if (base)
        *base = ptr;
    if (size)
        *size = n;
    return CCA_OK;
}

cca_status_t async_set_memory_fraction(double fraction, int device)
{
    cca_backend_t *be = AS->backend;
    cca_status_t st = device_ready(device);
    if (st != CCA_OK)
        return st;
    size_t free_bytes = 0, total = 0;
    st = be->mem_get_info(be->ctx, device, &free_bytes, &total);
    if (st != CCA_OK)
        return st;
    async_device_t *ad = &AS->devices[device];
    atomic_store(&ad->limit, (size_t)(fraction * (double)total));
    return CCA_OK;
}

/* The fraction in force on device: its limit over the device's memory (1.0: none set). */
double async_get_memory_fraction(int device)
{
    size_t limit = atomic_load(&AS->devices[device].limit);
    size_t total = AS->devices[device].total_memory;
    return limit == SIZE_MAX || total == 0 ? 1.0 : (double)limit / (double)total;
}

/* per_process_memory_fraction set at run time (cca_set_settings): every device's limit (0: none). */
void async_settings_fraction(double fraction)
{
    for (int d = 0; d < AS->device_count; d++)
        atomic_store(&AS->devices[d].limit,
                     fraction > 0.0 ? (size_t)(fraction * (double)AS->devices[d].total_memory)
                                    : SIZE_MAX);
}

/* ---- statistics ------------------------------------------------------------------------------- */

cca_status_t async_get_device_stats(int device, cca_device_stats_t *stats)
{
    cca_backend_t *be = AS->backend;
    uint64_t v[4] = {0, 0, 0, 0};
    static const cca_mempool_attr_t attrs[4] = {CCA_MEMPOOL_RESERVED_CURRENT, CCA_MEMPOOL_RESERVED_HIGH,
                                                CCA_MEMPOOL_USED_CURRENT, CCA_MEMPOOL_USED_HIGH};
    /* A device not used yet reports zeros, without setting its pool up. */
    async_device_t *ad = &AS->devices[device];
    if (atomic_load_explicit(&ad->ready, memory_order_acquire)) {
        pthread_rwlock_wrlock(&ad->pool_lock);
        cca_status_t st = CCA_OK;
        for (int i = 0; i < 4 && st == CCA_OK; i++)
            st = be->mempool_get_attr(be->ctx, device, attrs[i], &v[i]);
        pthread_rwlock_unlock(&ad->pool_lock);
        if (st != CCA_OK)
            return st;
    }
    memset(stats, 0, sizeof(*stats));
    stats->reserved_bytes[CCA_STAT_ALL].current = (int64_t)v[0];
    stats->reserved_bytes[CCA_STAT_ALL].peak = (int64_t)v[1];
    stats->allocated_bytes[CCA_STAT_ALL].current = (int64_t)v[2];
    stats->allocated_bytes[CCA_STAT_ALL].peak = (int64_t)v[3];
    stats->active_bytes[CCA_STAT_ALL].current = (int64_t)v[2];
    stats->active_bytes[CCA_STAT_ALL].peak = (int64_t)v[3];
    return CCA_OK;
}

cca_status_t async_reset_peak_stats(int device)
{
    cca_backend_t *be = AS->backend;
    /* Zero is the only value these accept: it resets each mark to its current value. */
    cca_status_t st = be->mempool_set_attr(be->ctx, device, CCA_MEMPOOL_RESERVED_HIGH, 0);
    if (st == CCA_OK)
        st = be->mempool_set_attr(be->ctx, device, CCA_MEMPOOL_USED_HIGH, 0);
    return st;
}

cca_status_t async_reset_accumulated_stats(int device)
{
    (void)device;
    if (!atomic_exchange(&AS->warned_reset, true))
        cca_output("cca warning: for backend:cudaMallocAsync, resetting accumulated statistics "
                   "has no effect\n");
    return CCA_OK;
}

/* ---- graph capture -------------------------------------------------------------------------- */

/*
 * An allocation while a capture is underway or frees wait for one to end
 * (capture lock held): the frees deferred by a capture that has ended are
 * done now (PyTorch does them at the next allocation); one that fails stays
 * deferred, for the next.
 */
static void capture_flush_locked(void)
{
    async_capture_t *cap = &AS->capture;
    if (!cap->underway && cap->deferred_count) {
        size_t kept = 0;
        for (size_t i = 0; i < cap->deferred_count; i++) {
            uintptr_t p = cap->deferred[i];
            async_shard_t *sh = shard_of(p);
            pthread_mutex_lock(&sh->lock);
            async_entry_t *e = table_find_locked(sh, p, true);
            pthread_mutex_unlock(&sh->lock);
            cca_assert_internal(e && e->deferred);
            if (!e)
                continue;
            e->deferred = false;
            if (free_and_forget(sh, e) != CCA_OK) { /* put back in the table: retried */
                e->deferred = true;
                cap->deferred[kept++] = p;
            }
        }
        cap->deferred_count = kept;
    }
    atomic_store(&cap->active, cap->underway || cap->deferred_count != 0);
}

/* Grow *array (of elem bytes, *cap of them) to hold count + 1. False: out of host memory. */
static bool reserve_one(void **array, size_t *cap, size_t count, size_t elem)
{
    if (count < *cap)
        return true;
    size_t n = *cap ? *cap * 2 : 8;
    void *grown = realloc(*array, n * elem);
    if (!grown)
        return false;
    *array = grown;
    *cap = n;
    return true;
}

/* Remember (stream, device) among the streams frees were queued on in this capture (room made). */
static void add_free_stream(async_capture_t *cap, cca_stream_t stream, int device)
{
    for (size_t i = 0; i < cap->free_stream_count; i++)
        if (cap->free_streams[i].stream == stream && cap->free_streams[i].device == device)
            return;
    cap->free_streams[cap->free_stream_count++] = (async_use_t){stream, device};
}

/* cca_free while a capture is underway or frees are deferred (the capture lock taken). */
static cca_status_t capture_free(void *ptr)
{
    async_capture_t *cap = &AS->capture;
    uintptr_t p = (uintptr_t)ptr;
    async_shard_t *sh = shard_of(p);
    cca_status_t st = CCA_OK;
    pthread_mutex_lock(&cap->lock);
    pthread_mutex_lock(&sh->lock);
    async_entry_t *e = table_find_locked(sh, p, false);
    pthread_mutex_unlock(&sh->lock);
    if (!e) {
        st = not_allocated(ptr);
        goto out_unlock;
    }
    if (e->deferred) {
        st = cca_raise(CCA_ERR_INVALID_POINTER,
                       "cca_free: pointer %p was freed already (during a graph capture: its free "
                       "waits until the capture ends)",
                       ptr);
        goto out_unlock;
    }
    if (cap->underway && !e->captured) {
        /* PyTorch's Note [Avoid freeing uncaptured ptrs during CUDA graph capture] */
        if (!reserve_one((void **)&cap->deferred, &cap->deferred_cap, cap->deferred_count,
                         sizeof(*cap->deferred))) {
            st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory deferring a free");
            goto out_unlock;
        }
        if (!cap->warned_deferred) {
            cap->warned_deferred = true;
            cca_outputf("cca warning: freeAsync() was called on an uncaptured allocation during "
                       "graph capture (address = %p). This may be benign, for example, a Python "
                       "tensor in the capture might happen to shadow (use the same name as) an "
                       "unrelated temporary tensor from somewhere before capture, pushing the "
                       "earlier tensor out of scope. However, if the tensor we're freeing here IS "
                       "used by the capture, freeing it is an error, and may cause illegal memory "
                       "accesses or memory corruption during graph replay.\n",
                       ptr);
        }
        cap->deferred[cap->deferred_count++] = p;
        e->deferred = true;
        goto out_unlock;
    }
    if (!cap->underway && e->captured)
        warn_captured_free(e);
    if (cap->underway && !reserve_one((void **)&cap->free_streams, &cap->free_stream_cap,
                                      cap->free_stream_count, sizeof(*cap->free_streams))) {
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory in cca_free during a capture");
        goto out_unlock;
    }
    /* the stream the free is queued on (PyTorch's Note [Avoid dangling free streams ...]) */
    int device = e->device;
    cca_stream_t free_stream = e->use_count ? AS->devices[device].unifying : e->stream;
    pthread_mutex_lock(&sh->lock);
    (void)table_find_locked(sh, p, true);
    pthread_mutex_unlock(&sh->lock);
    st = free_and_forget(sh, e);
    if (st == CCA_OK && cap->underway)
        add_free_stream(cap, free_stream, device);
out_unlock:
    pthread_mutex_unlock(&cap->lock);
    return st;
}

cca_status_t async_begin_capture(int device, cca_stream_t stream)
{
    async_capture_t *cap = &AS->capture;
    cca_status_t st = CCA_OK;
    pthread_mutex_lock(&cap->lock);
    if (cap->underway) {
        st = cca_raise(CCA_ERR_BUSY, "Only one capture at a time is allowed in a process.");
    } else {
        cca_assert_internal(cap->free_stream_count == 0);
        cap->underway = true;
        cap->device = device;
        cap->stream = stream;
        atomic_store(&cap->active, true); /* sequentially consistent with fast_enter */
        /* calls that passed fast_enter before: done before the capture begins */
        while (atomic_load(&cap->fast_calls))
            sched_yield();
    }
    pthread_mutex_unlock(&cap->lock);
    return st;
}

cca_status_t async_end_capture(int device)
{
    async_capture_t *cap = &AS->capture;
    cca_status_t st = CCA_OK;
    pthread_mutex_lock(&cap->lock);
    if (!cap->underway) {
        st = cca_raise(CCA_ERR_BUSY, "CudaMallocAsync::notifyCaptureAboutToEnd called, but "
                                     "CudaMallocAsync::capture_underway is false.");
        goto out_unlock;
    }
    /* the capture stream (PyTorch's current stream of device) waits for every free stream;
     * a failure leaves the capture underway, to end again */
    cca_stream_t target = device == cap->device ? cap->stream : NULL;
    for (size_t i = 0; i < cap->free_stream_count; i++) {
        st = sync_streams(cap->free_streams[i].device, cap->free_streams[i].stream, device, target);
        if (st != CCA_OK)
            goto out_unlock;
    }
    cap->free_stream_count = 0;
    cap->underway = false;
    atomic_store(&cap->active, cap->deferred_count != 0);
out_unlock:
    pthread_mutex_unlock(&cap->lock);
    return st;
}

size_t async_deferred_count(void)
{
    if (!AS)
        return 0;
    pthread_mutex_lock(&AS->capture.lock);
    size_t n = AS->capture.deferred_count;
    pthread_mutex_unlock(&AS->capture.lock);
    return n;
}
