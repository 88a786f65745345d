/*
 * pinned.h - the pinned host caching allocator's records, shared by its
 * files, lowest first: host_classes.c (the free lists), host_map.c (the
 * pointer map and the range array), host_system.c (pinned memory from the
 * system: backend host_alloc, malloc + parallel pre-fault + host_register,
 * the reserve segment), host_events.c (events and the background thread),
 * host_alloc.c (the allocator core: creation, malloc, free, record,
 * empty_cache, statistics). The process-global instance and the public
 * cca_host_* functions are in runtime/host_api.c.
 */
#ifndef CCA_PINNED_H
#define CCA_PINNED_H

#include <pthread.h>
#include <stdatomic.h>

#include "host.h"

#define HOST_CLASSES 64         /* size classes: ceil(log2(size)) */
#define HOST_MAP_BUCKETS 1024   /* initial pointer map buckets (a power of two) */
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

/*
 * A block of pinned memory. Fields marked (lock) are read and written only
 * under host_alloc.lock; ptr, size and origin do not change while the block
 * is known.
 */
typedef struct host_block {
    void *ptr;                    /* start of the block */
    size_t size;                  /* bytes (the rounded request) */
    struct host_block *map_next;  /* pointer map chain (lock) */
    struct host_block *free_next; /* free list link (lock) */
    host_origin_t origin;
    bool allocated;               /* in use by a caller (lock) */
    bool captured;                /* used by work a stream capture recorded: kept, never handed out
                                   * again, since the graph's replays read it (lock) */
    size_t nuses;                 /* streams recorded since allocation (lock) */
    atomic_size_t event_count;    /* events recorded at free, not yet completed */
    size_t uses_cap;              /* capacity of uses (lock) */
    host_use_t *uses;             /* inline_uses or a heap array (lock) */
    host_use_t inline_uses[HOST_INLINE_USES];
} host_block_t;

/* One size class: a LIFO free list and its accumulated counters (all under the lock),
 * on a cache line of its own. */
typedef struct host_class {
    _Alignas(64) host_block_t *head;
    size_t count; /* blocks in the list */
    size_t odd;   /* blocks whose size is not exactly 2^index (page-rounded) */
    /* accumulated active statistics of this class's blocks */
    int64_t taken, taken_bytes;       /* handed to callers */
    int64_t returned, returned_bytes; /* available again (or released) after free */
} host_class_t;

/* The active (requests, bytes) statistics: current values and their exact peaks (lock). */
typedef struct host_active {
    int64_t requests, bytes;
    int64_t peak_requests, peak_bytes;
} host_active_t;

/* An event: pooled (block NULL) or pending for a block. */
typedef struct host_event {
    cca_event_t event;
    int device;
    host_block_t *block;
    struct host_event *next;
} host_event_t;

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

    /*
     * The cached path's state: the free lists, the pointer map (a chained
     * hash table of every block by exact address), the blocks' (lock)
     * fields and the active statistics, all under one lock, so that a
     * cached allocation or free takes one atomic exchange and updates the
     * exact statistics with plain stores. The backend is never called with
     * it held, and no other lock is taken under it.
     */
    _Alignas(64) cca_spinlock_t lock;
    host_active_t active;
    host_block_t **buckets;
    size_t nbuckets; /* power of two */
    size_t mapped;   /* blocks in the map */
    host_class_t classes[HOST_CLASSES];

    /* every block, sorted by address, for interior pointers and destroy */
    pthread_mutex_t ranges_lock;
    host_block_t **ranges;
    size_t nranges, ranges_cap;
    size_t ranges_reserved; /* room kept for blocks being obtained or given back:
                               nranges + ranges_reserved <= ranges_cap */

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

    /* background event thread */
    pthread_mutex_t bg_lock;
    pthread_cond_t bg_cond;
    pthread_t bg_thread;
    bool bg_running;
    bool bg_stop;
};

/* ---- small helpers ------------------------------------------------------------------ */

static inline size_t host_ceil_log2(size_t x)
{
    if (x <= 1)
        return 0;
    return 64 - (size_t)__builtin_clzll((unsigned long long)(x - 1));
}

static inline size_t host_round_up(size_t x, size_t to)
{
    return (x + to - 1) & ~(to - 1);
}

static inline void host_stat_increase(cca_stat_t *s, int64_t amount)
{
    s->current += amount;
    s->allocated += amount;
    if (s->current > s->peak)
        s->peak = s->current;
}

static inline void host_stat_decrease(cca_stat_t *s, int64_t amount)
{
    s->current -= amount;
    s->freed += amount;
}

/* A block of size bytes handed to a caller: counted in its class and active. Lock held. */
static inline void host_count_taken_locked(host_alloc_t *h, host_class_t *c, size_t size)
{
    host_active_t *a = &h->active;
    c->taken++;
    c->taken_bytes += (int64_t)size;
    a->requests++;
    a->bytes += (int64_t)size;
    if (a->requests > a->peak_requests)
        a->peak_requests = a->requests;
    if (a->bytes > a->peak_bytes)
        a->peak_bytes = a->bytes;
}

/* A block of size bytes available again (or released) after free: no longer active. Lock held. */
static inline void host_count_returned_locked(host_alloc_t *h, host_class_t *c, size_t size)
{
    c->returned++;
    c->returned_bytes += (int64_t)size;
    h->active.requests--;
    h->active.bytes -= (int64_t)size;
}

static inline void host_duration_add(cca_duration_stat_t *d, int64_t us)
{
    d->total += us;
    d->count += 1;
    if (us > d->max)
        d->max = us;
    if (d->count == 1 || us < d->min)
        d->min = us;
}

/* ---- host_map.c: the pointer map and the range array ----------------------------------- */

static inline size_t host_ptr_hash(const void *ptr)
{
    uint64_t x = (uint64_t)(uintptr_t)ptr * 0x9E3779B97F4A7C15ull;
    return (size_t)(x >> 20);
}

/* The block starting exactly at ptr, or NULL. Lock held. */
static inline host_block_t *host_map_find_locked(host_alloc_t *h, const void *ptr)
{
    host_block_t *b = h->buckets[host_ptr_hash(ptr) & (h->nbuckets - 1)];
    while (b && b->ptr != ptr)
        b = b->map_next;
    return b;
}

/* Whether the allocator's next host allocation for its own records is to fail
 * (host_test_fail_records); asked before each. */
bool host_records_alloc_fails(void);

/* Add b to the pointer map (lock held; on table growth failure the chains grow). */
void host_map_insert_locked(host_alloc_t *h, host_block_t *b);
/* Add b to the pointer map, taking the lock. */
void host_map_insert(host_alloc_t *h, host_block_t *b);
/* Remove b from the pointer map, taking the lock. */
void host_map_remove(host_alloc_t *h, host_block_t *b);
/* Keep room in the range array for one more block, so that its insertion cannot
 * fail once its memory is obtained. Returns CCA_OK or CCA_ERR_OUT_OF_MEMORY. */
cca_status_t host_ranges_reserve(host_alloc_t *h);
/* Give back the room host_ranges_reserve kept, unused. */
void host_ranges_unreserve(host_alloc_t *h);
/* Add b to the range array in the room a host_ranges_reserve kept. */
void host_ranges_insert(host_alloc_t *h, host_block_t *b);
/* Remove b from the sorted range array; keep_room: its place stays kept for a
 * host_ranges_insert or host_ranges_unreserve. */
void host_ranges_remove(host_alloc_t *h, host_block_t *b, bool keep_room);
/* Start and size of the block holding ptr (interior included); false if none. */
bool host_ranges_find(host_alloc_t *h, const void *ptr, void **base, size_t *size);
/* Raise CCA_ERR_INVALID_POINTER for a pointer that is not the start of a block. */
cca_status_t host_raise_unknown(host_alloc_t *h, const void *ptr, const char *what);

/* ---- host_classes.c: free lists ------------------------------------------------------------- */

/* Cache b (not allocated, no pending event) at the head of its class. Lock held. */
void host_class_push_locked(host_alloc_t *h, host_block_t *b);
/* The general case of host_class_pop_locked: a class holding page-rounded blocks. */
host_block_t *host_class_take_locked(host_alloc_t *h, size_t index, size_t size);

/*
 * Take a free block of at least size bytes from class index, counted as taken
 * and active: the most recently freed one, or, where the class holds
 * page-rounded blocks, the smallest that fits. NULL if none. Lock held.
 */
static inline host_block_t *host_class_pop_locked(host_alloc_t *h, size_t index, size_t size)
{
    host_class_t *c = &h->classes[index];
    if (c->odd)
        return host_class_take_locked(h, index, size);
    host_block_t *b = c->head;
    if (!b)
        return NULL;
    c->head = b->free_next;
    b->free_next = NULL;
    c->count--;
    b->allocated = true;
    host_count_taken_locked(h, c, b->size);
    return b;
}

/*
 * A freed block with no pending event: counted as returned and no longer
 * active, then cached; a block larger than pinned_max_cached_size (and not
 * carved from the reserve segment) is not cached: true, and the caller gives
 * it back with host_block_discard once the lock is dropped. Lock held.
 */
static inline bool host_block_available_locked(host_alloc_t *h, host_block_t *b)
{
    size_t size = b->size;
    size_t index = host_ceil_log2(size);
    host_class_t *c = &h->classes[index];
    host_count_returned_locked(h, c, size);
    if (size > atomic_load_explicit(&h->max_cached, memory_order_relaxed) &&
        b->origin != HOST_ORIGIN_RESERVE)
        return true;
    b->free_next = c->head;
    c->head = b;
    c->count++;
    if (size != (size_t)1 << index)
        c->odd++;
    return false;
}

/* ---- host_system.c: pinned memory from the system -------------------------------------- */

/* Obtain size bytes of pinned memory from the system, timed and counted. */
cca_status_t host_sys_alloc(host_alloc_t *h, size_t size, void **ptr, host_origin_t *origin);
/* Give system memory back the way host_sys_alloc obtained it, timed and counted. */
cca_status_t host_sys_free(host_alloc_t *h, void *ptr, host_origin_t origin);
/* Carve size bytes (page-rounded) from the reserve segment, creating it on first
 * use; *ptr = NULL when there is no room. Returns CCA_OK or the creation status. */
cca_status_t host_reserve_take(host_alloc_t *h, size_t size, void **ptr);
/* Give a block (not carved, in no free list, not allocated, no pending event) back
 * to the system and forget it; on failure it is unchanged and still known. */
cca_status_t host_block_release(host_alloc_t *h, host_block_t *b);
/* A freed block whose events all completed: host_block_available_locked, then
 * host_block_discard where asked (takes the lock). */
void host_block_available(host_alloc_t *h, host_block_t *b);
/* Give back a block that host_block_available_locked did not cache; cached after
 * all if that fails (empty_cache retries). Lock not held. */
void host_block_discard(host_alloc_t *h, host_block_t *b);

/* ---- host_events.c: events and the background thread ---------------------------------- */

/* A pooled event of device, or a new one. Returns CCA_OK, CCA_ERR_OUT_OF_MEMORY,
 * backend status. */
cca_status_t host_event_get(host_alloc_t *h, int device, host_event_t **out);
/* Return an event to its device's pool. */
void host_event_put(host_alloc_t *h, host_event_t *e);
/* Collect completed events, oldest first, stopping at the first not ready. Returns
 * CCA_OK or the status of a failed query. */
cca_status_t host_process_events(host_alloc_t *h);
/* Start (CCA_OK, CCA_ERR_BACKEND) or stop the background event thread. */
cca_status_t host_background_start(host_alloc_t *h);
void host_background_stop(host_alloc_t *h);

#endif /* CCA_PINNED_H */
