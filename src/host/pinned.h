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
    _Alignas(64) cca_spinlock_t lock;
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
    _Alignas(64) cca_spinlock_t lock;
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

/*
 * The active (requests, bytes) statistics, moved together without a lock: on
 * x86-64 one 16-byte compare-and-swap updates both currents (one atomic
 * read-modify-write instead of two, the largest cost of a cached pair);
 * elsewhere, and under ThreadSanitizer (which cannot see the instruction), two
 * fetch-adds. Each peak is exact: raised by compare-and-swap from the value
 * its own update produced.
 */
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
#define HOST_ACTIVE_CAS16 1
#endif

typedef struct host_active {
    _Alignas(16) int64_t requests; /* current values: atomic loads, host_active_move writes */
    int64_t bytes;
    _Atomic int64_t peak_requests, peak_bytes;
} host_active_t;

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
    _Alignas(64) host_active_t active;

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

/* The block size serving a request: next power of two, or page above the threshold. */
static inline size_t host_round(host_alloc_t *h, size_t size)
{
    if (size > atomic_load_explicit(&h->round_threshold, memory_order_relaxed))
        return host_round_up(size, HOST_PAGE);
    return (size_t)1 << host_ceil_log2(size);
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

static inline void host_peak_raise(_Atomic int64_t *peak_slot, int64_t now)
{
    int64_t peak = atomic_load_explicit(peak_slot, memory_order_relaxed);
    while (now > peak && !atomic_compare_exchange_weak_explicit(peak_slot, &peak, now,
                                                                memory_order_relaxed,
                                                                memory_order_relaxed)) {
    }
}

/* Add requests and bytes (negative: take away) to the active statistics. */
static inline void host_active_move(host_alloc_t *h, int64_t requests, int64_t bytes)
{
    host_active_t *a = &h->active;
    int64_t now_requests, now_bytes;
#ifdef HOST_ACTIVE_CAS16
    int64_t lo = __atomic_load_n(&a->requests, __ATOMIC_RELAXED);
    int64_t hi = __atomic_load_n(&a->bytes, __ATOMIC_RELAXED);
    unsigned char done;
    do {
        now_requests = lo + requests;
        now_bytes = hi + bytes;
        /* on failure rdx:rax receive the current pair, and the loop retries */
        __asm__ __volatile__("lock cmpxchg16b %1\n\tsetz %0"
                             : "=q"(done), "+m"(a->requests), "+a"(lo), "+d"(hi)
                             : "b"(now_requests), "c"(now_bytes)
                             : "memory", "cc");
    } while (!done);
#else
    now_requests = __atomic_add_fetch(&a->requests, requests, __ATOMIC_RELAXED);
    now_bytes = __atomic_add_fetch(&a->bytes, bytes, __ATOMIC_RELAXED);
#endif
    if (requests > 0) {
        host_peak_raise(&a->peak_requests, now_requests);
        host_peak_raise(&a->peak_bytes, now_bytes);
    }
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

/* The pointer map shard of ptr. */
host_shard_t *host_shard_of(host_alloc_t *h, const void *ptr);
/* The block starting exactly at ptr in shard s, or NULL (shard lock held). */
host_block_t *host_map_find_locked(host_shard_t *s, const void *ptr);
/* Add b to the pointer map (takes the shard lock). */
void host_map_insert(host_alloc_t *h, host_block_t *b);
/* Remove b from the pointer map (takes the shard lock). */
void host_map_remove(host_alloc_t *h, host_block_t *b);
/* Add b to the range array. Returns CCA_OK or CCA_ERR_OUT_OF_MEMORY. */
cca_status_t host_ranges_insert(host_alloc_t *h, host_block_t *b);
/* Remove b from the sorted range array. */
void host_ranges_remove(host_alloc_t *h, host_block_t *b);
/* Start and size of the block holding ptr (interior included); false if none. */
bool host_ranges_find(host_alloc_t *h, const void *ptr, void **base, size_t *size);
/* Raise CCA_ERR_INVALID_POINTER for a pointer that is not the start of a block. */
cca_status_t host_raise_unknown(host_alloc_t *h, const void *ptr, const char *what);

/* ---- host_alloc.c: free lists ---------------------------------------------------------------- */

/* Cache b in its class; returned: b comes back from a caller (counted as such). */
void host_class_push(host_alloc_t *h, host_block_t *b, bool returned);
/* A free block of at least size bytes from size's class (most recently freed, or the
 * smallest that fits where the class holds page-rounded blocks); NULL if none. */
host_block_t *host_class_take(host_alloc_t *h, size_t size);
/* Count a block handed out (taken) or returned outside the free-list operations. */
void host_class_count(host_alloc_t *h, size_t size, bool taken);

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
/* A freed block whose events all completed: cached, or given back when larger than
 * pinned_max_cached_size. */
void host_block_available(host_alloc_t *h, host_block_t *b);

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
