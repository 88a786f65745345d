/*
 * host.c - the pinned host caching allocator (PyTorch's CachingHostAllocator).
 *
 * Requests are rounded up to a power of two (or, above
 * pinned_max_round_threshold, to a page) and served from one LIFO free list
 * per power-of-two size class, each with its own lock. A miss takes pinned
 * memory from the system: backend host_alloc (cudaHostAlloc), or malloc +
 * parallel page pre-fault + host_register, or a bump carve from the reserve
 * segment. Blocks are never split or merged.
 *
 * A freed block that was used on other streams (host_record_event) gets one
 * event per stream; it returns to its free list only when all of them have
 * completed. Completed events are collected at allocation time (oldest first,
 * stopping at the first one not ready) or by a background thread.
 *
 * Invariants:
 *  - every block held from the system is in the pointer map (sharded hash,
 *    exact address) and in the sorted range array (interior lookups) until
 *    it is given back; a block is in at most one free list, and only when it
 *    is not allocated and has no pending event;
 *  - the backend is never called with any of this file's locks held, and no
 *    two locks are ever held together.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "host.h"

#define HOST_CLASSES 64         /* size classes: ceil(log2(size)) */
#define HOST_SHARDS 64          /* pointer map shards */
#define HOST_PAGE ((size_t)4096) /* page rounding and pre-fault stride, as PyTorch */
#define HOST_HUGE ((size_t)2 << 20) /* register mode: alignment of large buffers */
#define HOST_INLINE_USES 4      /* streams kept in the block before spilling to the heap */
#define HOST_MAX_REGISTER_THREADS 128
#define HOST_POLL_NS 100000     /* background thread poll while events are pending */

/* How a block's memory was obtained, hence how it is given back. */
typedef enum host_origin {
    HOST_ORIGIN_ALLOC = 0,    /* backend host_alloc; backend host_free */
    HOST_ORIGIN_REGISTER = 1, /* aligned malloc + host_register; host_unregister + free */
    HOST_ORIGIN_RESERVE = 2,  /* carved from the reserve segment; never given back alone */
} host_origin_t;

/* A (stream, device) pair the block was used on. */
typedef struct host_use {
    cca_stream_t stream;
    int device;
} host_use_t;

typedef struct host_block {
    void *ptr;                  /* start of the block */
    size_t size;                /* bytes (the rounded request) */
    host_origin_t origin;
    atomic_bool allocated;      /* in use by a caller */
    atomic_size_t event_count;  /* events recorded at free, not yet completed */
    size_t nuses;               /* streams recorded since allocation (shard lock) */
    size_t uses_cap;            /* capacity of uses */
    host_use_t *uses;           /* inline_uses or a heap array */
    host_use_t inline_uses[HOST_INLINE_USES];
    struct host_block *map_next;  /* pointer map chain (shard lock) */
    struct host_block *free_next; /* free list link (class lock) */
} host_block_t;

/* One size class: LIFO free list. */
typedef struct host_class {
    _Alignas(64) pthread_mutex_t lock;
    host_block_t *head;
    size_t count; /* blocks in the list */
    size_t odd;   /* blocks whose size is not exactly 2^index (page-rounded) */
    /* accumulated active statistics of this class's blocks (kept here, under
     * the lock the hot path takes anyway, so that it adds no shared counter) */
    int64_t taken, taken_bytes;       /* handed to callers */
    int64_t returned, returned_bytes; /* available again (or released) after free */
} host_class_t;

/* One shard of the pointer map: chained hash table. */
typedef struct host_shard {
    _Alignas(64) pthread_mutex_t lock;
    host_block_t **buckets;
    size_t nbuckets; /* power of two */
    size_t count;
} host_shard_t;

/* An event: pooled (block NULL) or pending for a block. */
typedef struct host_event {
    cca_event_t event;
    int device;
    host_block_t *block;
    struct host_event *next;
} host_event_t;

/* The current value and peak of a statistic, updated without a lock. */
typedef struct host_gauge {
    _Atomic int64_t current, peak;
} host_gauge_t;

struct host_alloc {
    cca_backend_t *backend;

    /* settings, changed at run time by host_apply_settings */
    atomic_size_t round_threshold;      /* bytes; above: page rounding */
    atomic_size_t max_cached;           /* bytes; larger freed blocks go back */
    atomic_size_t register_threads;     /* pre-fault threads */
    atomic_size_t reserve_request;      /* bytes of reserve segment to create; 0 none */
    atomic_bool use_register;
    atomic_bool use_background;
    pthread_mutex_t settings_lock;      /* serialises host_apply_settings */

    host_class_t classes[HOST_CLASSES];
    host_shard_t shards[HOST_SHARDS];

    /* every block, sorted by address, for interior pointers and destroy */
    pthread_mutex_t ranges_lock;
    host_block_t **ranges;
    size_t nranges, ranges_cap;

    /* pending events, oldest at head */
    _Alignas(64) pthread_mutex_t events_lock;
    host_event_t *ev_head, *ev_tail;
    atomic_size_t ev_pending;

    /* pooled events per device */
    pthread_mutex_t pool_lock;
    host_event_t *pool[CCA_MAX_DEVICES];

    /* the reserve segment */
    pthread_mutex_t reserve_lock;
    int reserve_state;          /* 0 none, 1 being created, 2 ready */
    char *reserve_base;
    size_t reserve_size;        /* bytes */
    size_t reserve_used;        /* bytes carved (page multiples) */
    host_origin_t reserve_origin;

    /* slow-path statistics */
    pthread_mutex_t stats_lock;
    cca_stat_t allocations, allocated_bytes;
    int64_t num_host_alloc, num_host_free;
    cca_duration_stat_t alloc_time, free_time; /* us */
    /* hot-path statistics: current and exact peak (accumulated: per class) */
    _Alignas(64) host_gauge_t active_requests;
    host_gauge_t active_bytes;

    /* background event thread */
    pthread_mutex_t bg_lock;
    pthread_cond_t bg_cond;
    pthread_t bg_thread;
    bool bg_running;
    bool bg_stop;
};

/* ------------------------------------------------------------------------ */
/* Small helpers                                                             */
/* ------------------------------------------------------------------------ */

static size_t ceil_log2(size_t x)
{
    if (x <= 1)
        return 0;
    return 64 - (size_t)__builtin_clzll((unsigned long long)(x - 1));
}

static size_t round_up(size_t x, size_t to)
{
    return (x + to - 1) & ~(to - 1);
}

/* The block size serving a request: next power of two, or page above the threshold. */
static size_t host_round(host_alloc_t *h, size_t size)
{
    if (size > atomic_load_explicit(&h->round_threshold, memory_order_relaxed))
        return round_up(size, HOST_PAGE);
    return (size_t)1 << ceil_log2(size);
}

static void stat_increase(cca_stat_t *s, int64_t amount)
{
    s->current += amount;
    s->allocated += amount;
    if (s->current > s->peak)
        s->peak = s->current;
}

static void stat_decrease(cca_stat_t *s, int64_t amount)
{
    s->current -= amount;
    s->freed += amount;
}

static void gauge_add(host_gauge_t *s, int64_t amount)
{
    int64_t now = atomic_fetch_add_explicit(&s->current, amount, memory_order_relaxed) + amount;
    int64_t peak = atomic_load_explicit(&s->peak, memory_order_relaxed);
    while (now > peak && !atomic_compare_exchange_weak_explicit(&s->peak, &peak, now,
                                                                memory_order_relaxed,
                                                                memory_order_relaxed)) {
    }
}

static void gauge_sub(host_gauge_t *s, int64_t amount)
{
    atomic_fetch_sub_explicit(&s->current, amount, memory_order_relaxed);
}

static void duration_add(cca_duration_stat_t *d, int64_t us)
{
    d->total += us;
    d->count += 1;
    if (us > d->max)
        d->max = us;
    if (d->count == 1 || us < d->min)
        d->min = us;
}

/* ------------------------------------------------------------------------ */
/* The pointer map and the range array                                      */
/* ------------------------------------------------------------------------ */

static size_t ptr_hash(const void *ptr)
{
    uint64_t x = (uint64_t)(uintptr_t)ptr * 0x9E3779B97F4A7C15ull;
    return (size_t)(x >> 20);
}

static host_shard_t *shard_of(host_alloc_t *h, const void *ptr)
{
    return &h->shards[(ptr_hash(ptr) >> 24) & (HOST_SHARDS - 1)];
}

static host_block_t *map_find_locked(host_shard_t *s, const void *ptr)
{
    host_block_t *b = s->buckets[ptr_hash(ptr) & (s->nbuckets - 1)];
    while (b && b->ptr != ptr)
        b = b->map_next;
    return b;
}

/* Double the bucket array when the load passes 1; best effort (chains grow on failure). */
static void map_grow_locked(host_shard_t *s)
{
    size_t n = s->nbuckets * 2;
    host_block_t **buckets = calloc(n, sizeof(*buckets));
    if (!buckets)
        return;
    for (size_t i = 0; i < s->nbuckets; i++) {
        host_block_t *b = s->buckets[i];
        while (b) {
            host_block_t *next = b->map_next;
            size_t j = ptr_hash(b->ptr) & (n - 1);
            b->map_next = buckets[j];
            buckets[j] = b;
            b = next;
        }
    }
    free(s->buckets);
    s->buckets = buckets;
    s->nbuckets = n;
}

static void map_insert(host_alloc_t *h, host_block_t *b)
{
    host_shard_t *s = shard_of(h, b->ptr);
    pthread_mutex_lock(&s->lock);
    if (s->count >= s->nbuckets)
        map_grow_locked(s);
    size_t i = ptr_hash(b->ptr) & (s->nbuckets - 1);
    b->map_next = s->buckets[i];
    s->buckets[i] = b;
    s->count++;
    pthread_mutex_unlock(&s->lock);
}

static void map_remove(host_alloc_t *h, host_block_t *b)
{
    host_shard_t *s = shard_of(h, b->ptr);
    pthread_mutex_lock(&s->lock);
    host_block_t **link = &s->buckets[ptr_hash(b->ptr) & (s->nbuckets - 1)];
    while (*link && *link != b)
        link = &(*link)->map_next;
    if (*link) {
        *link = b->map_next;
        s->count--;
    }
    pthread_mutex_unlock(&s->lock);
}

/* Index of the first block whose address is > ptr. ranges_lock held. */
static size_t ranges_upper_locked(host_alloc_t *h, const void *ptr)
{
    size_t lo = 0, hi = h->nranges;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if ((uintptr_t)h->ranges[mid]->ptr <= (uintptr_t)ptr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Add b to the range array. Returns CCA_OK or CCA_ERR_OUT_OF_MEMORY. */
static cca_status_t ranges_insert(host_alloc_t *h, host_block_t *b)
{
    cca_status_t status = CCA_OK;
    pthread_mutex_lock(&h->ranges_lock);
    if (h->nranges == h->ranges_cap) {
        size_t cap = h->ranges_cap ? h->ranges_cap * 2 : 64;
        host_block_t **ranges = realloc(h->ranges, cap * sizeof(*ranges));
        if (!ranges) {
            status = cca_raise(CCA_ERR_OUT_OF_MEMORY,
                               "out of host memory for the pinned block table (%zu blocks)",
                               h->nranges);
            goto out_unlock;
        }
        h->ranges = ranges;
        h->ranges_cap = cap;
    }
    size_t at = ranges_upper_locked(h, b->ptr);
    memmove(&h->ranges[at + 1], &h->ranges[at], (h->nranges - at) * sizeof(*h->ranges));
    h->ranges[at] = b;
    h->nranges++;
out_unlock:
    pthread_mutex_unlock(&h->ranges_lock);
    return status;
}

static void ranges_remove(host_alloc_t *h, host_block_t *b)
{
    pthread_mutex_lock(&h->ranges_lock);
    size_t at = ranges_upper_locked(h, b->ptr);
    if (at > 0 && h->ranges[at - 1] == b) {
        memmove(&h->ranges[at - 1], &h->ranges[at], (h->nranges - at) * sizeof(*h->ranges));
        h->nranges--;
    }
    pthread_mutex_unlock(&h->ranges_lock);
}

/* Start and size of the block holding ptr (interior included); false if none. */
static bool ranges_find(host_alloc_t *h, const void *ptr, void **base, size_t *size)
{
    bool found = false;
    pthread_mutex_lock(&h->ranges_lock);
    size_t at = ranges_upper_locked(h, ptr);
    if (at > 0) {
        host_block_t *b = h->ranges[at - 1];
        if ((uintptr_t)ptr < (uintptr_t)b->ptr + b->size) {
            *base = b->ptr;
            *size = b->size;
            found = true;
        }
    }
    pthread_mutex_unlock(&h->ranges_lock);
    return found;
}

/* Raise CCA_ERR_INVALID_POINTER for a pointer that is not the start of a block. */
static cca_status_t raise_unknown(host_alloc_t *h, const void *ptr, const char *what)
{
    void *base;
    size_t size;
    if (ranges_find(h, ptr, &base, &size))
        return cca_raise(CCA_ERR_INVALID_POINTER,
                         "%s: pointer %p is inside the pinned block at %p (%zu bytes), not at "
                         "its start",
                         what, ptr, base, size);
    return cca_raise(CCA_ERR_INVALID_POINTER,
                     "%s: pointer %p was not allocated by cca's pinned host allocator", what,
                     ptr);
}

/* ------------------------------------------------------------------------ */
/* Free lists                                                                */
/* ------------------------------------------------------------------------ */

/* Cache b in its class; returned: b comes back from a caller (counted as such). */
static void class_push(host_alloc_t *h, host_block_t *b, bool returned)
{
    size_t index = ceil_log2(b->size);
    host_class_t *c = &h->classes[index];
    pthread_mutex_lock(&c->lock);
    if (returned) {
        c->returned++;
        c->returned_bytes += (int64_t)b->size;
    }
    b->free_next = c->head;
    c->head = b;
    c->count++;
    if (b->size != (size_t)1 << index)
        c->odd++;
    pthread_mutex_unlock(&c->lock);
}

/*
 * Take a free block of at least size bytes from size's class: the most
 * recently freed one, or, where the class holds page-rounded blocks, the
 * smallest that fits. NULL if none.
 */
static host_block_t *class_take(host_alloc_t *h, size_t size)
{
    size_t index = ceil_log2(size);
    host_class_t *c = &h->classes[index];
    host_block_t *found = NULL;
    pthread_mutex_lock(&c->lock);
    host_block_t **link = &c->head;
    if (c->odd) {
        host_block_t **best = NULL;
        for (host_block_t **it = &c->head; *it; it = &(*it)->free_next)
            if ((*it)->size >= size && (!best || (*it)->size < (*best)->size))
                best = it;
        link = best;
    }
    if (link && *link) {
        found = *link;
        *link = found->free_next;
        found->free_next = NULL;
        c->count--;
        if (found->size != (size_t)1 << index)
            c->odd--;
        c->taken++;
        c->taken_bytes += (int64_t)found->size;
    }
    pthread_mutex_unlock(&c->lock);
    return found;
}

/* Count a block handed out (taken) or returned outside the free-list operations. */
static void class_count(host_alloc_t *h, size_t size, bool taken)
{
    host_class_t *c = &h->classes[ceil_log2(size)];
    pthread_mutex_lock(&c->lock);
    if (taken) {
        c->taken++;
        c->taken_bytes += (int64_t)size;
    } else {
        c->returned++;
        c->returned_bytes += (int64_t)size;
    }
    pthread_mutex_unlock(&c->lock);
}

/* ------------------------------------------------------------------------ */
/* The system (slow) path                                                    */
/* ------------------------------------------------------------------------ */

typedef struct prefault_range {
    char *start;
    char *end;
} prefault_range_t;

static void *prefault_run(void *arg)
{
    prefault_range_t *r = arg;
    for (char *p = r->start; p < r->end; p += HOST_PAGE)
        *(volatile char *)p = 0;
    return NULL;
}

/*
 * Touch one byte per page of [ptr, ptr + size) (ptr page-aligned) so the
 * pages exist before registration, on up to nthreads threads, each on a
 * contiguous run of pages. Falls back to fewer threads if one cannot start.
 */
static void prefault(char *ptr, size_t size, size_t nthreads)
{
    size_t pages = size / HOST_PAGE + (size % HOST_PAGE != 0);
    if (nthreads > HOST_MAX_REGISTER_THREADS)
        nthreads = HOST_MAX_REGISTER_THREADS;
    if (nthreads > pages)
        nthreads = pages;
    if (nthreads <= 1) {
        prefault_range_t all = {ptr, ptr + size};
        prefault_run(&all);
        return;
    }
    pthread_t threads[HOST_MAX_REGISTER_THREADS];
    bool started[HOST_MAX_REGISTER_THREADS];
    prefault_range_t ranges[HOST_MAX_REGISTER_THREADS];
    for (size_t i = 0; i < nthreads; i++) {
        ranges[i].start = ptr + pages * i / nthreads * HOST_PAGE;
        ranges[i].end = i + 1 == nthreads ? ptr + size : ptr + pages * (i + 1) / nthreads * HOST_PAGE;
    }
    /* Range 0 runs on the calling thread. */
    for (size_t i = 1; i < nthreads; i++)
        started[i] = pthread_create(&threads[i], NULL, prefault_run, &ranges[i]) == 0;
    prefault_run(&ranges[0]);
    for (size_t i = 1; i < nthreads; i++) {
        if (started[i])
            pthread_join(threads[i], NULL);
        else
            prefault_run(&ranges[i]);
    }
}

/*
 * Register mode: page-aligned malloc (2 MiB-aligned, transparent huge pages
 * where large), parallel pre-fault, host_register, and a check that the
 * device sees the same address. Returns CCA_OK, CCA_ERR_OUT_OF_MEMORY,
 * CCA_ERR_NOT_SUPPORTED (addresses differ), or the backend's status.
 */
static cca_status_t register_alloc(host_alloc_t *h, size_t size, void **out)
{
    cca_backend_t *be = h->backend;
    size_t length = round_up(size, HOST_PAGE);
    size_t align = length >= HOST_HUGE ? HOST_HUGE : HOST_PAGE;
    void *ptr = NULL, *device_ptr = NULL;
    cca_status_t status;

    if (posix_memalign(&ptr, align, length) != 0)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY,
                         "out of host memory: malloc of %zu bytes for pinned memory failed", length);
#ifdef MADV_HUGEPAGE
    if (align == HOST_HUGE)
        (void)madvise(ptr, length, MADV_HUGEPAGE);
#endif
    prefault(ptr, length, atomic_load_explicit(&h->register_threads, memory_order_relaxed));

    status = be->host_register(be->ctx, ptr, length, &device_ptr);
    if (status != CCA_OK)
        goto out_free;
    if (device_ptr != ptr) {
        (void)be->host_unregister(be->ctx, ptr);
        status = cca_raise(CCA_ERR_NOT_SUPPORTED,
                           "host and device pointers differ after host_register (%p vs %p): "
                           "this system cannot use pinned_use_cuda_host_register:True; "
                           "leave it False (the default)",
                           ptr, device_ptr);
        goto out_free;
    }
    *out = ptr;
    return CCA_OK;

out_free:
    free(ptr);
    return status;
}

/* Obtain size bytes of pinned memory from the system, timed and counted. */
static cca_status_t sys_alloc(host_alloc_t *h, size_t size, void **ptr, host_origin_t *origin)
{
    cca_backend_t *be = h->backend;
    bool use_register = atomic_load_explicit(&h->use_register, memory_order_relaxed);
    uint64_t t0 = cca_now_ns();
    cca_status_t status = use_register ? register_alloc(h, size, ptr)
                                       : be->host_alloc(be->ctx, size, ptr);
    uint64_t t1 = cca_now_ns();
    if (status != CCA_OK)
        return status;
    *origin = use_register ? HOST_ORIGIN_REGISTER : HOST_ORIGIN_ALLOC;
    pthread_mutex_lock(&h->stats_lock);
    h->num_host_alloc++;
    duration_add(&h->alloc_time, (int64_t)((t1 - t0) / 1000));
    pthread_mutex_unlock(&h->stats_lock);
    return CCA_OK;
}

/* Give system memory back the way sys_alloc obtained it, timed and counted. */
static cca_status_t sys_free(host_alloc_t *h, void *ptr, host_origin_t origin)
{
    cca_backend_t *be = h->backend;
    uint64_t t0 = cca_now_ns();
    cca_status_t status;
    if (origin == HOST_ORIGIN_REGISTER) {
        status = be->host_unregister(be->ctx, ptr);
        if (status == CCA_OK)
            free(ptr);
    } else {
        status = be->host_free(be->ctx, ptr);
    }
    uint64_t t1 = cca_now_ns();
    if (status != CCA_OK)
        return status;
    pthread_mutex_lock(&h->stats_lock);
    h->num_host_free++;
    duration_add(&h->free_time, (int64_t)((t1 - t0) / 1000));
    pthread_mutex_unlock(&h->stats_lock);
    return CCA_OK;
}

/*
 * Carve size bytes (page-rounded) from the reserve segment, creating the
 * segment on first use. *ptr = NULL when there is no reserve, it is being
 * created by another thread, or it has no room left. Returns CCA_OK or the
 * status of the segment's creation.
 */
static cca_status_t reserve_take(host_alloc_t *h, size_t size, void **ptr)
{
    size_t carve = round_up(size, HOST_PAGE);
    *ptr = NULL;
    pthread_mutex_lock(&h->reserve_lock);
    if (h->reserve_state == 0) {
        size_t want = atomic_load_explicit(&h->reserve_request, memory_order_relaxed);
        if (want == 0) {
            pthread_mutex_unlock(&h->reserve_lock);
            return CCA_OK;
        }
        h->reserve_state = 1;
        pthread_mutex_unlock(&h->reserve_lock);

        void *base = NULL;
        host_origin_t origin = HOST_ORIGIN_ALLOC;
        cca_status_t status = sys_alloc(h, want, &base, &origin);

        pthread_mutex_lock(&h->reserve_lock);
        if (status != CCA_OK) {
            h->reserve_state = 0;
            pthread_mutex_unlock(&h->reserve_lock);
            return status;
        }
        h->reserve_base = base;
        h->reserve_size = want;
        h->reserve_used = 0;
        h->reserve_origin = origin;
        h->reserve_state = 2;
    }
    if (h->reserve_state == 2 && carve <= h->reserve_size - h->reserve_used) {
        *ptr = h->reserve_base + h->reserve_used;
        h->reserve_used += carve;
    }
    pthread_mutex_unlock(&h->reserve_lock);
    return CCA_OK;
}

/*
 * Give a block (not carved, in no free list, not allocated, no pending
 * event) back to the system and forget it. On failure the block is
 * unchanged and still known; the caller caches it again.
 */
static cca_status_t block_release(host_alloc_t *h, host_block_t *b)
{
    /* Forget it first: the system may hand the address out again at once. */
    map_remove(h, b);
    ranges_remove(h, b);
    cca_status_t status = sys_free(h, b->ptr, b->origin);
    if (status != CCA_OK) {
        /* ranges cannot fail here: removing left room for one */
        (void)ranges_insert(h, b);
        map_insert(h, b);
        return status;
    }
    pthread_mutex_lock(&h->stats_lock);
    stat_decrease(&h->allocations, 1);
    stat_decrease(&h->allocated_bytes, (int64_t)b->size);
    pthread_mutex_unlock(&h->stats_lock);
    if (b->uses != b->inline_uses)
        free(b->uses);
    free(b);
    return CCA_OK;
}

/*
 * A freed block whose events all completed: no longer active; cached, or
 * given back when larger than pinned_max_cached_size (cached anyway if that
 * fails: empty_cache retries).
 */
static void block_available(host_alloc_t *h, host_block_t *b)
{
    size_t size = b->size;
    gauge_sub(&h->active_requests, 1);
    gauge_sub(&h->active_bytes, (int64_t)size);
    if (b->origin != HOST_ORIGIN_RESERVE &&
        size > atomic_load_explicit(&h->max_cached, memory_order_relaxed) &&
        block_release(h, b) == CCA_OK) {
        class_count(h, size, false);
        return;
    }
    class_push(h, b, true);
}

/* ------------------------------------------------------------------------ */
/* Events                                                                    */
/* ------------------------------------------------------------------------ */

/* A pooled event of device, or a new one. Returns CCA_OK, CCA_ERR_OUT_OF_MEMORY, backend status. */
static cca_status_t event_get(host_alloc_t *h, int device, host_event_t **out)
{
    pthread_mutex_lock(&h->pool_lock);
    host_event_t *e = h->pool[device];
    if (e)
        h->pool[device] = e->next;
    pthread_mutex_unlock(&h->pool_lock);
    if (!e) {
        e = calloc(1, sizeof(*e));
        if (!e)
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for a pinned-block event");
        cca_status_t status = h->backend->event_create(h->backend->ctx, device, &e->event);
        if (status != CCA_OK) {
            free(e);
            return status;
        }
        e->device = device;
    }
    e->next = NULL;
    e->block = NULL;
    *out = e;
    return CCA_OK;
}

static void event_put(host_alloc_t *h, host_event_t *e)
{
    e->block = NULL;
    pthread_mutex_lock(&h->pool_lock);
    e->next = h->pool[e->device];
    h->pool[e->device] = e;
    pthread_mutex_unlock(&h->pool_lock);
}

/*
 * Collect completed events, oldest first, stopping at the first that is not
 * ready; blocks whose last event completed become available. Returns CCA_OK
 * or the status of a failed query (that event stays pending).
 */
static cca_status_t process_events(host_alloc_t *h)
{
    cca_backend_t *be = h->backend;
    for (;;) {
        pthread_mutex_lock(&h->events_lock);
        host_event_t *e = h->ev_head;
        if (e) {
            h->ev_head = e->next;
            if (!h->ev_head)
                h->ev_tail = NULL;
        }
        pthread_mutex_unlock(&h->events_lock);
        if (!e)
            return CCA_OK;

        cca_status_t status = be->event_query(be->ctx, e->device, e->event);
        if (status != CCA_OK) {
            pthread_mutex_lock(&h->events_lock);
            e->next = h->ev_head;
            h->ev_head = e;
            if (!h->ev_tail)
                h->ev_tail = e;
            pthread_mutex_unlock(&h->events_lock);
            return status == CCA_ERR_NOT_READY ? CCA_OK : status;
        }
        host_block_t *b = e->block;
        atomic_fetch_sub(&h->ev_pending, 1);
        event_put(h, e);
        if (atomic_fetch_sub(&b->event_count, 1) == 1)
            block_available(h, b);
    }
}

static void *background_main(void *arg)
{
    host_alloc_t *h = arg;
    pthread_mutex_lock(&h->bg_lock);
    while (!h->bg_stop) {
        if (atomic_load(&h->ev_pending) == 0) {
            pthread_cond_wait(&h->bg_cond, &h->bg_lock);
            continue;
        }
        pthread_mutex_unlock(&h->bg_lock);
        (void)process_events(h);
        pthread_mutex_lock(&h->bg_lock);
        if (!h->bg_stop && atomic_load(&h->ev_pending) != 0) {
            /* Events are not signalled to us: poll, as PyTorch's thread does. */
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += HOST_POLL_NS;
            if (until.tv_nsec >= 1000000000L) {
                until.tv_sec++;
                until.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&h->bg_cond, &h->bg_lock, &until);
        }
    }
    pthread_mutex_unlock(&h->bg_lock);
    return NULL;
}

static cca_status_t background_start(host_alloc_t *h)
{
    if (h->bg_running)
        return CCA_OK;
    h->bg_stop = false;
    if (pthread_create(&h->bg_thread, NULL, background_main, h) != 0)
        return cca_raise(CCA_ERR_BACKEND, "cannot start the pinned-memory event thread");
    h->bg_running = true;
    return CCA_OK;
}

static void background_stop(host_alloc_t *h)
{
    if (!h->bg_running)
        return;
    pthread_mutex_lock(&h->bg_lock);
    h->bg_stop = true;
    pthread_cond_signal(&h->bg_cond);
    pthread_mutex_unlock(&h->bg_lock);
    pthread_join(h->bg_thread, NULL);
    h->bg_running = false;
}

/* ------------------------------------------------------------------------ */
/* Creation and destruction                                                  */
/* ------------------------------------------------------------------------ */

static void store_settings(host_alloc_t *h, const cca_settings_t *s)
{
    size_t threads = s->pinned_num_register_threads ? s->pinned_num_register_threads : 1;
    atomic_store(&h->round_threshold, s->pinned_max_round_threshold);
    atomic_store(&h->max_cached, s->pinned_max_cached_size);
    atomic_store(&h->register_threads, threads);
    atomic_store(&h->reserve_request, s->pinned_reserve_segment_size);
    atomic_store(&h->use_register, s->pinned_use_cuda_host_register);
    atomic_store(&h->use_background, s->pinned_use_background_threads);
}

cca_status_t host_create(cca_backend_t *backend, const cca_settings_t *settings,
                         host_alloc_t **out)
{
    cca_status_t status;
    if (!backend || !settings || !out)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "host_create: backend, settings and out are required");
    host_alloc_t *h = calloc(1, sizeof(*h));
    if (!h)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the pinned allocator");
    h->backend = backend;
    store_settings(h, settings);
    for (size_t i = 0; i < HOST_SHARDS; i++) {
        h->shards[i].nbuckets = 16;
        h->shards[i].buckets = calloc(h->shards[i].nbuckets, sizeof(host_block_t *));
        if (!h->shards[i].buckets) {
            status = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the pinned allocator");
            goto out_free;
        }
        pthread_mutex_init(&h->shards[i].lock, NULL);
    }
    for (size_t i = 0; i < HOST_CLASSES; i++)
        pthread_mutex_init(&h->classes[i].lock, NULL);
    pthread_mutex_init(&h->settings_lock, NULL);
    pthread_mutex_init(&h->ranges_lock, NULL);
    pthread_mutex_init(&h->events_lock, NULL);
    pthread_mutex_init(&h->pool_lock, NULL);
    pthread_mutex_init(&h->reserve_lock, NULL);
    pthread_mutex_init(&h->stats_lock, NULL);
    pthread_mutex_init(&h->bg_lock, NULL);
    pthread_cond_init(&h->bg_cond, NULL);
    if (settings->pinned_use_background_threads) {
        status = background_start(h);
        if (status != CCA_OK) {
            host_destroy(h);
            return status;
        }
    }
    *out = h;
    return CCA_OK;

out_free:
    for (size_t i = 0; i < HOST_SHARDS; i++) {
        if (h->shards[i].buckets)
            pthread_mutex_destroy(&h->shards[i].lock);
        free(h->shards[i].buckets);
    }
    free(h);
    return status;
}

void host_destroy(host_alloc_t *h)
{
    if (!h)
        return;
    cca_backend_t *be = h->backend;
    background_stop(h);

    /* Pending events: their blocks go back below with everything else. */
    for (host_event_t *e = h->ev_head, *next; e; e = next) {
        next = e->next;
        (void)be->event_destroy(be->ctx, e->device, e->event);
        free(e);
    }
    for (int d = 0; d < CCA_MAX_DEVICES; d++) {
        for (host_event_t *e = h->pool[d], *next; e; e = next) {
            next = e->next;
            (void)be->event_destroy(be->ctx, e->device, e->event);
            free(e);
        }
    }
    for (size_t i = 0; i < h->nranges; i++) {
        host_block_t *b = h->ranges[i];
        if (b->origin != HOST_ORIGIN_RESERVE)
            (void)sys_free(h, b->ptr, b->origin);
        if (b->uses != b->inline_uses)
            free(b->uses);
        free(b);
    }
    if (h->reserve_state == 2)
        (void)sys_free(h, h->reserve_base, h->reserve_origin);
    free(h->ranges);
    for (size_t i = 0; i < HOST_SHARDS; i++) {
        free(h->shards[i].buckets);
        pthread_mutex_destroy(&h->shards[i].lock);
    }
    for (size_t i = 0; i < HOST_CLASSES; i++)
        pthread_mutex_destroy(&h->classes[i].lock);
    pthread_mutex_destroy(&h->settings_lock);
    pthread_mutex_destroy(&h->ranges_lock);
    pthread_mutex_destroy(&h->events_lock);
    pthread_mutex_destroy(&h->pool_lock);
    pthread_mutex_destroy(&h->reserve_lock);
    pthread_mutex_destroy(&h->stats_lock);
    pthread_mutex_destroy(&h->bg_lock);
    pthread_cond_destroy(&h->bg_cond);
    free(h);
}

cca_status_t host_apply_settings(host_alloc_t *h, const cca_settings_t *settings)
{
    cca_status_t status = CCA_OK;
    if (!h || !settings)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "host_apply_settings: NULL argument");
    pthread_mutex_lock(&h->settings_lock);
    store_settings(h, settings);
    if (settings->pinned_use_background_threads)
        status = background_start(h);
    else
        background_stop(h);
    pthread_mutex_unlock(&h->settings_lock);
    return status;
}

/* ------------------------------------------------------------------------ */
/* Allocation, free, record                                                  */
/* ------------------------------------------------------------------------ */

cca_status_t host_malloc(host_alloc_t *h, void **ptr, size_t size)
{
    cca_status_t status;
    if (!ptr)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_host_malloc: ptr is NULL");
    if (size == 0) {
        *ptr = NULL;
        return CCA_OK;
    }
    if (size >= CCA_MAX_REQUEST)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_host_malloc: %zu bytes is not a valid size (1 EB or more)", size);

    if (atomic_load_explicit(&h->ev_pending, memory_order_relaxed) != 0 &&
        !atomic_load_explicit(&h->use_background, memory_order_relaxed))
        (void)process_events(h); /* a failed query leaves its block cached */

    size_t rounded = host_round(h, size);
    host_block_t *b = class_take(h, rounded);
    if (b) {
        atomic_store_explicit(&b->allocated, true, memory_order_release);
        gauge_add(&h->active_requests, 1);
        gauge_add(&h->active_bytes, (int64_t)b->size);
        *ptr = b->ptr;
        return CCA_OK;
    }

    /* Slow path: the reserve segment, else the system. */
    void *mem = NULL;
    host_origin_t origin = HOST_ORIGIN_RESERVE;
    status = reserve_take(h, rounded, &mem);
    if (status != CCA_OK)
        return status;
    if (!mem) {
        status = sys_alloc(h, rounded, &mem, &origin);
        if (status != CCA_OK)
            return status;
    }
    b = calloc(1, sizeof(*b));
    if (!b) {
        status = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for a pinned block record");
        goto out_release;
    }
    b->ptr = mem;
    b->size = rounded;
    b->origin = origin;
    b->uses = b->inline_uses;
    b->uses_cap = HOST_INLINE_USES;
    atomic_init(&b->allocated, true);
    atomic_init(&b->event_count, 0);
    status = ranges_insert(h, b);
    if (status != CCA_OK)
        goto out_free_block;
    map_insert(h, b);

    pthread_mutex_lock(&h->stats_lock);
    stat_increase(&h->allocations, 1);
    stat_increase(&h->allocated_bytes, (int64_t)rounded);
    pthread_mutex_unlock(&h->stats_lock);
    class_count(h, rounded, true);
    gauge_add(&h->active_requests, 1);
    gauge_add(&h->active_bytes, (int64_t)rounded);
    *ptr = mem;
    return CCA_OK;

out_free_block:
    free(b);
out_release:
    /* A carve stays in the reserve segment (freed with it); system memory goes back. */
    if (origin != HOST_ORIGIN_RESERVE)
        (void)sys_free(h, mem, origin);
    return status;
}

cca_status_t host_free(host_alloc_t *h, void *ptr)
{
    cca_backend_t *be = h->backend;
    cca_status_t status = CCA_OK;
    if (!ptr)
        return CCA_OK;

    host_shard_t *s = shard_of(h, ptr);
    pthread_mutex_lock(&s->lock);
    host_block_t *b = map_find_locked(s, ptr);
    if (!b) {
        pthread_mutex_unlock(&s->lock);
        return raise_unknown(h, ptr, "cca_host_free");
    }
    if (!atomic_load_explicit(&b->allocated, memory_order_acquire)) {
        pthread_mutex_unlock(&s->lock);
        return cca_raise(CCA_ERR_INVALID_POINTER,
                         "cca_host_free: pointer %p (pinned block of %zu bytes) was already freed",
                         ptr, b->size);
    }
    atomic_store_explicit(&b->allocated, false, memory_order_relaxed);
    size_t nuses = b->nuses;
    host_use_t inline_copy[HOST_INLINE_USES];
    host_use_t *uses = inline_copy;
    size_t uses_cap = b->uses_cap;
    if (b->uses == b->inline_uses) {
        memcpy(inline_copy, b->inline_uses, nuses * sizeof(*uses));
    } else {
        uses = b->uses;
        b->uses = b->inline_uses;
        b->uses_cap = HOST_INLINE_USES;
    }
    b->nuses = 0;
    pthread_mutex_unlock(&s->lock);

    if (nuses == 0) {
        block_available(h, b);
        return CCA_OK;
    }

    /* One event per stream, recorded with no lock held. */
    host_event_t *first = NULL, *last = NULL;
    size_t recorded = 0;
    for (size_t i = 0; i < nuses; i++) {
        host_event_t *e = NULL;
        status = event_get(h, uses[i].device, &e);
        if (status != CCA_OK)
            goto out_restore;
        status = be->event_record(be->ctx, uses[i].device, e->event, uses[i].stream);
        if (status != CCA_OK) {
            event_put(h, e);
            goto out_restore;
        }
        e->block = b;
        if (last)
            last->next = e;
        else
            first = e;
        last = e;
        recorded++;
    }
    if (uses != inline_copy)
        free(uses);
    atomic_store(&b->event_count, recorded);

    pthread_mutex_lock(&h->events_lock);
    if (h->ev_tail)
        h->ev_tail->next = first;
    else
        h->ev_head = first;
    h->ev_tail = last;
    atomic_fetch_add(&h->ev_pending, recorded);
    pthread_mutex_unlock(&h->events_lock);

    if (atomic_load_explicit(&h->use_background, memory_order_relaxed)) {
        pthread_mutex_lock(&h->bg_lock);
        pthread_cond_signal(&h->bg_cond);
        pthread_mutex_unlock(&h->bg_lock);
    }
    return CCA_OK;

out_restore:
    /* Events already recorded go back to the pool; the block is allocated again. */
    for (host_event_t *e = first, *next; e; e = next) {
        next = e->next;
        event_put(h, e);
    }
    pthread_mutex_lock(&s->lock);
    if (uses == inline_copy) {
        memcpy(b->inline_uses, inline_copy, nuses * sizeof(*uses));
    } else {
        b->uses = uses;
        b->uses_cap = uses_cap;
    }
    b->nuses = nuses;
    atomic_store_explicit(&b->allocated, true, memory_order_relaxed);
    pthread_mutex_unlock(&s->lock);
    return status;
}

/* Add (stream, device) to b's uses. Shard lock held. Returns CCA_OK or CCA_ERR_OUT_OF_MEMORY. */
static cca_status_t block_add_use_locked(host_block_t *b, cca_stream_t stream, int device)
{
    for (size_t i = 0; i < b->nuses; i++)
        if (b->uses[i].stream == stream && b->uses[i].device == device)
            return CCA_OK;
    if (b->nuses == b->uses_cap) {
        size_t cap = b->uses_cap * 2;
        host_use_t *uses = malloc(cap * sizeof(*uses));
        if (!uses)
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory recording a stream use");
        memcpy(uses, b->uses, b->nuses * sizeof(*uses));
        if (b->uses != b->inline_uses)
            free(b->uses);
        b->uses = uses;
        b->uses_cap = cap;
    }
    b->uses[b->nuses++] = (host_use_t){stream, device};
    return CCA_OK;
}

cca_status_t host_record_event(host_alloc_t *h, void *ptr, cca_stream_t stream)
{
    cca_backend_t *be = h->backend;
    int device = 0;
    cca_status_t status;
    if (!ptr)
        return cca_raise(CCA_ERR_INVALID_POINTER, "cca_host_record_event: pointer is NULL");
    status = be->get_device(be->ctx, &device);
    if (status != CCA_OK)
        return status;
    if (device < 0 || device >= CCA_MAX_DEVICES)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_host_record_event: current device %d is out of range", device);

    void *base = ptr;
    for (int attempt = 0; attempt < 2; attempt++) {
        host_shard_t *s = shard_of(h, base);
        pthread_mutex_lock(&s->lock);
        host_block_t *b = map_find_locked(s, base);
        if (b) {
            if (atomic_load_explicit(&b->allocated, memory_order_acquire))
                status = block_add_use_locked(b, stream, device);
            else
                status = cca_raise(CCA_ERR_INVALID_POINTER,
                                   "cca_host_record_event: pointer %p is in a pinned block that "
                                   "is not allocated (freed)",
                                   ptr);
            pthread_mutex_unlock(&s->lock);
            return status;
        }
        pthread_mutex_unlock(&s->lock);
        size_t size;
        if (attempt == 0 && !ranges_find(h, ptr, &base, &size))
            break;
    }
    return cca_raise(CCA_ERR_INVALID_POINTER,
                     "cca_host_record_event: pointer %p was not allocated by cca's pinned host "
                     "allocator",
                     ptr);
}

cca_status_t host_empty_cache(host_alloc_t *h)
{
    cca_status_t first_error = process_events(h);
    for (size_t i = 0; i < HOST_CLASSES; i++) {
        host_class_t *c = &h->classes[i];
        host_block_t *taken = NULL;
        pthread_mutex_lock(&c->lock);
        host_block_t **link = &c->head;
        while (*link) {
            host_block_t *b = *link;
            if (b->origin == HOST_ORIGIN_RESERVE) {
                link = &b->free_next;
                continue;
            }
            *link = b->free_next;
            c->count--;
            if (b->size != (size_t)1 << i)
                c->odd--;
            b->free_next = taken;
            taken = b;
        }
        pthread_mutex_unlock(&c->lock);
        while (taken) {
            host_block_t *b = taken;
            taken = b->free_next;
            b->free_next = NULL;
            cca_status_t status = block_release(h, b);
            if (status != CCA_OK) {
                class_push(h, b, false);
                if (first_error == CCA_OK)
                    first_error = status;
            }
        }
    }
    /* The pooled events go back too: after freeing everything, nothing is left. */
    host_event_t *events[CCA_MAX_DEVICES];
    pthread_mutex_lock(&h->pool_lock);
    for (int d = 0; d < CCA_MAX_DEVICES; d++) {
        events[d] = h->pool[d];
        h->pool[d] = NULL;
    }
    pthread_mutex_unlock(&h->pool_lock);
    cca_backend_t *be = h->backend;
    for (int d = 0; d < CCA_MAX_DEVICES; d++)
        for (host_event_t *e = events[d], *next; e; e = next) {
            next = e->next;
            cca_status_t status = be->event_destroy(be->ctx, e->device, e->event);
            if (status == CCA_OK) {
                free(e);
                continue;
            }
            /* keep it pooled (destroyed at shutdown) and report the failure */
            if (first_error == CCA_OK)
                first_error = status;
            pthread_mutex_lock(&h->pool_lock);
            e->next = h->pool[e->device];
            h->pool[e->device] = e;
            pthread_mutex_unlock(&h->pool_lock);
        }
    return first_error;
}

/* ------------------------------------------------------------------------ */
/* Statistics and validity                                                   */
/* ------------------------------------------------------------------------ */

cca_status_t host_get_stats(host_alloc_t *h, cca_host_stats_t *stats)
{
    if (!stats)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_host_get_stats: stats is NULL");
    memset(stats, 0, sizeof(*stats));
    pthread_mutex_lock(&h->stats_lock);
    stats->allocations = h->allocations;
    stats->allocated_bytes = h->allocated_bytes;
    stats->num_host_alloc = h->num_host_alloc;
    stats->num_host_free = h->num_host_free;
    stats->host_alloc_time = h->alloc_time;
    stats->host_free_time = h->free_time;
    pthread_mutex_unlock(&h->stats_lock);
    for (size_t i = 0; i < HOST_CLASSES; i++) {
        host_class_t *c = &h->classes[i];
        pthread_mutex_lock(&c->lock);
        stats->active_requests.allocated += c->taken;
        stats->active_requests.freed += c->returned;
        stats->active_bytes.allocated += c->taken_bytes;
        stats->active_bytes.freed += c->returned_bytes;
        pthread_mutex_unlock(&c->lock);
    }
    stats->active_requests.current = atomic_load(&h->active_requests.current);
    stats->active_requests.peak = atomic_load(&h->active_requests.peak);
    stats->active_bytes.current = atomic_load(&h->active_bytes.current);
    stats->active_bytes.peak = atomic_load(&h->active_bytes.peak);
    return CCA_OK;
}

void host_reset_accumulated_stats(host_alloc_t *h)
{
    pthread_mutex_lock(&h->stats_lock);
    h->allocations.allocated = h->allocations.freed = 0;
    h->allocated_bytes.allocated = h->allocated_bytes.freed = 0;
    h->num_host_alloc = h->num_host_free = 0;
    memset(&h->alloc_time, 0, sizeof(h->alloc_time));
    memset(&h->free_time, 0, sizeof(h->free_time));
    pthread_mutex_unlock(&h->stats_lock);
    for (size_t i = 0; i < HOST_CLASSES; i++) {
        host_class_t *c = &h->classes[i];
        pthread_mutex_lock(&c->lock);
        c->taken = c->taken_bytes = c->returned = c->returned_bytes = 0;
        pthread_mutex_unlock(&c->lock);
    }
}

void host_reset_peak_stats(host_alloc_t *h)
{
    pthread_mutex_lock(&h->stats_lock);
    h->allocations.peak = h->allocations.current;
    h->allocated_bytes.peak = h->allocated_bytes.current;
    h->alloc_time.max = h->alloc_time.min = 0;
    h->free_time.max = h->free_time.min = 0;
    pthread_mutex_unlock(&h->stats_lock);
    atomic_store(&h->active_requests.peak, atomic_load(&h->active_requests.current));
    atomic_store(&h->active_bytes.peak, atomic_load(&h->active_bytes.current));
}

bool host_is_valid(host_alloc_t *h)
{
    bool valid = true;
    size_t cached = 0;
    for (size_t i = 0; i < HOST_CLASSES; i++) {
        host_class_t *c = &h->classes[i];
        size_t count = 0, odd = 0;
        pthread_mutex_lock(&c->lock);
        for (host_block_t *b = c->head; b; b = b->free_next) {
            count++;
            if (b->size != (size_t)1 << i)
                odd++;
            if (ceil_log2(b->size) != i || atomic_load(&b->allocated) ||
                atomic_load(&b->event_count) != 0)
                valid = false;
        }
        if (count != c->count || odd != c->odd)
            valid = false;
        cached += count;
        pthread_mutex_unlock(&c->lock);
    }
    size_t mapped = 0;
    for (size_t i = 0; i < HOST_SHARDS; i++) {
        pthread_mutex_lock(&h->shards[i].lock);
        mapped += h->shards[i].count;
        pthread_mutex_unlock(&h->shards[i].lock);
    }
    pthread_mutex_lock(&h->ranges_lock);
    if (mapped != h->nranges || cached > h->nranges)
        valid = false;
    for (size_t i = 1; i < h->nranges; i++)
        if ((uintptr_t)h->ranges[i - 1]->ptr + h->ranges[i - 1]->size > (uintptr_t)h->ranges[i]->ptr)
            valid = false;
    pthread_mutex_unlock(&h->ranges_lock);
    pthread_mutex_lock(&h->stats_lock);
    if (h->allocations.current != (int64_t)mapped)
        valid = false;
    pthread_mutex_unlock(&h->stats_lock);
    return valid;
}

/* ------------------------------------------------------------------------ */
/* The global instance and the public functions                             */
/* ------------------------------------------------------------------------ */

static _Atomic(host_alloc_t *) global_host;

cca_status_t host_global_init(cca_backend_t *backend, const cca_settings_t *settings)
{
    if (atomic_load(&global_host))
        return cca_raise(CCA_ERR_BUSY, "the pinned host allocator is already initialised");
    host_alloc_t *h;
    cca_status_t status = host_create(backend, settings, &h);
    if (status != CCA_OK)
        return status;
    atomic_store(&global_host, h);
    return CCA_OK;
}

void host_global_shutdown(void)
{
    host_alloc_t *h = atomic_exchange(&global_host, NULL);
    host_destroy(h);
}

host_alloc_t *host_global(void)
{
    return atomic_load_explicit(&global_host, memory_order_acquire);
}

/* Initialise cca if needed and return the global host allocator in *h. */
static cca_status_t global_get(host_alloc_t **h)
{
    cca_status_t status = cca_init();
    if (status != CCA_OK)
        return status;
    *h = host_global();
    if (!*h)
        return cca_raise(CCA_ERR_NOT_INITIALIZED, "the pinned host allocator is not initialised");
    return CCA_OK;
}

cca_status_t cca_host_malloc(void **ptr, size_t size)
{
    host_alloc_t *h;
    cca_status_t status = global_get(&h);
    return status != CCA_OK ? status : host_malloc(h, ptr, size);
}

cca_status_t cca_host_free(void *ptr)
{
    host_alloc_t *h;
    cca_status_t status = global_get(&h);
    return status != CCA_OK ? status : host_free(h, ptr);
}

cca_status_t cca_host_record_event(void *ptr, cca_stream_t stream)
{
    host_alloc_t *h;
    cca_status_t status = global_get(&h);
    return status != CCA_OK ? status : host_record_event(h, ptr, stream);
}

cca_status_t cca_host_empty_cache(void)
{
    host_alloc_t *h;
    cca_status_t status = global_get(&h);
    return status != CCA_OK ? status : host_empty_cache(h);
}

cca_status_t cca_host_get_stats(cca_host_stats_t *stats)
{
    host_alloc_t *h;
    cca_status_t status = global_get(&h);
    return status != CCA_OK ? status : host_get_stats(h, stats);
}

cca_status_t cca_host_reset_accumulated_stats(void)
{
    host_alloc_t *h;
    cca_status_t status = global_get(&h);
    if (status == CCA_OK)
        host_reset_accumulated_stats(h);
    return status;
}

cca_status_t cca_host_reset_peak_stats(void)
{
    host_alloc_t *h;
    cca_status_t status = global_get(&h);
    if (status == CCA_OK)
        host_reset_peak_stats(h);
    return status;
}
