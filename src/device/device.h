/*
 * device.h - the device caching allocator's internal structures.
 *
 * Memory comes from the backend in segments; a segment is tiled by blocks
 * (a doubly linked list in address order). A free block sits in exactly one
 * bin of the pool of its own stream and size kind (small: <= 1 MiB requests,
 * large: the rest). Each (device, stream) has its own stream pool with its
 * own lock, so threads on different streams never meet on the fast path;
 * slow paths (new segment, release, OOM, GC, empty cache) take the device
 * lock first, then stream pool locks (lock order: device -> stream pool ->
 * pointer-map shard / stats lock).
 */
#ifndef CCA_DEVICE_H
#define CCA_DEVICE_H

#include <pthread.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "internal.h"
#include "settings.h"
#include "trace.h"

/* PyTorch's constants. */
#define CCA_MIN_BLOCK_SIZE ((size_t)512)            /* all sizes are multiples of this */
#define CCA_SMALL_SIZE ((size_t)1048576)            /* largest "small" request */
#define CCA_SMALL_BUFFER ((size_t)2097152)          /* small-pool segment size */
#define CCA_MIN_LARGE_ALLOC ((size_t)10485760)      /* from here segments are rounded */
#define CCA_ROUND_LARGE ((size_t)2097152)           /* rounding of large segments */

/* Size classes: 32 sub-classes per power of two. */
#define CCA_BIN_SUB_BITS 5
#define CCA_BIN_COUNT (64 << CCA_BIN_SUB_BITS)
#define CCA_BIN_WORDS (CCA_BIN_COUNT / 64)

struct cca_pool;
struct cca_segment;
struct cca_private_pool;

typedef struct cca_block {
    /* first cache line: what best fit, the bins, the pointer map and a free's merge read */
    uintptr_t addr;             /* device address */
    size_t size;                /* bytes */
    struct cca_block *prev;     /* neighbour below in the segment, NULL at its start */
    struct cca_block *next;     /* neighbour above, NULL at its end */
    struct cca_block *bin_prev; /* links in a free bin (or in the pending list) */
    struct cca_block *bin_next;
    struct cca_block *map_next; /* chain in the pointer map */
    uint16_t bin;               /* bin index while free */
    bool allocated;             /* handed out to the caller */
    bool in_bin;                /* sitting in a free bin */
    uint32_t stream_use_count;  /* streams recorded with record_stream */
    /* second line */
    struct cca_pool *pool;      /* stream pool (and kind) it belongs to; NULL: uncached */
    struct cca_segment *segment;/* the segment it tiles */
    size_t requested_size;      /* bytes the caller asked for (last allocation) */
    int64_t gc_count_base;      /* pool's get_free_block count when it was cached */
    uint64_t free_tick;         /* its stream pool's free_tick when it was last returned (free) */
    cca_stream_t *stream_uses;  /* the streams recorded (heap, stream_use_cap of them), NULL
                                   before the first record_stream */
    uint32_t stream_use_cap;
    uint32_t event_count;       /* outstanding record_stream events */
    union {
        uint32_t plan_serial;   /* compact_memory: 1 + its serial in its pool's plan record
                                   (plan.c) while allocated, 0: not recorded */
        int32_t device;         /* uncached mode (no pool): its device index */
    };
    bool oversize;              /* counted in oversize_allocations (max_split_size may change) */
    bool mapped;                /* false: unmapped address space of an expandable segment,
                                   in its pool's unmapped list (bin links), never in a bin */
    bool aliased;               /* compact_memory: unmapped in the allocator's view (mapped
                                   false), its handles mapped again elsewhere, its own mappings
                                   kept in the backend until its stream's work on them is done;
                                   in the device's aliased list (bin links), in no other list;
                                   address space nothing maps or allocates meanwhile */
} cca_block_t;

/* Two cache lines, the hot fields in the first (pool_block_struct aligns them). */
_Static_assert(sizeof(cca_block_t) == 128, "a block struct is two cache lines");
_Static_assert(offsetof(cca_block_t, pool) == 64, "the hot fields fill the first line");

/* One granule of an expandable segment's address space. */
typedef struct cca_vmm_granule {
    cca_phys_handle_t handle;   /* physical memory mapped there */
    bool present;               /* mapped */
} cca_vmm_granule_t;

/* A granule whose unmap or release failed: retried by the next release (expandable.c). */
typedef struct cca_vmm_orphan {
    uintptr_t addr;             /* where it is still mapped, if mapped */
    size_t size;                /* bytes */
    cca_phys_handle_t handle;
    bool mapped;                /* still mapped at addr (outside every block) */
} cca_vmm_orphan_t;

/* What an expandable segment adds to a segment (expandable.c). */
typedef struct cca_expandable {
    size_t granule;             /* bytes mapped at a time: 2 MiB small, large_segment_size large */
    size_t max_handles;         /* granules the reservation spans */
    cca_vmm_granule_t *handles; /* granules [0, handle_count) (PyTorch's handles_) */
    size_t handle_count;        /* one past the highest mapped granule */
    size_t handle_cap;
    size_t mapped_bytes;        /* bytes mapped */
    bool compact;               /* compact_memory: device-granularity granules, lent to growth */
    bool free_failed;           /* emptied, but the reservation's free failed: empty_cache retries */
    struct cca_pool *pool;      /* the pool it belongs to (fixed) */
} cca_expandable_t;

/* One segment from the backend (one cudaMalloc, or one expandable reservation). */
typedef struct cca_segment {
    uintptr_t base;             /* device address */
    size_t size;                /* bytes */
    cca_stream_t stream;        /* allocation stream */
    bool is_small;              /* small-pool segment */
    bool oversize;              /* counted in oversize_segments (max_split_size may change) */
    struct cca_block *head;     /* its first block */
    const struct cca_private_pool *private_pool; /* its blocks' private pool, NULL: the
                                   default pools (fixed for its life: read without its pool's
                                   lock) */
    cca_expandable_t *es;       /* non-NULL: an expandable segment (base, size: the reservation) */
    cca_pool_free_fn user_free; /* non-NULL: from its private pool's own allocator, goes back there */
    void *user_ctx;
    struct cca_segment *prev_seg, *next_seg; /* device's list of segments */
} cca_segment_t;

/* Free blocks of one kind (small or large) of one stream. */
typedef struct cca_bins {
    uint64_t words[CCA_BIN_WORDS]; /* bit b: bin b non-empty */
    uint64_t summary;              /* bit w: words[w] non-zero */
    cca_block_t *heads[CCA_BIN_COUNT]; /* each bin sorted by (size, addr) */
    size_t count;                  /* free blocks */
    uint64_t version;              /* moves at every insert and remove */
} cca_bins_t;

#include "bins.h" /* insert, remove, best fit: inline */

struct cca_device;

/* The pool of one (device, stream) and kind. */
typedef struct cca_pool {
    struct cca_stream_pool *owner;
    bool is_small;
    _Atomic int64_t *gc_calls;    /* the device's count of garbage collector calls of this kind */
    /* its kind's rows of the device's ops table, for ops_apply's locked mode (set with the
     * pool, the table living as long): current values, peaks, counts, and the other kind's
     * current values */
    int64_t *ops_cur, *ops_peak;
    struct ops_count *ops_n;
    const int64_t *ops_other;
    uint32_t expandable_segments; /* live expandable segments of this pool */
    struct cca_block *unmapped;   /* their unmapped blocks, by address */
    /* A freed block whose merge with its free upper neighbour is put off
     * (pool_free_block): the next request of its size takes it back where
     * best fit would split it off again; any other use of the pool merges it
     * first (pool_flush). Its statistics are already those of the merge. */
    struct cca_block *held;
    struct cca_block *last_alloc; /* the block handed out last: only it is held back */
    /* true: the held block's free statistics are not yet applied; pool_flush
     * applies them, or the held block's next allocation folds them into its
     * own (ops_apply_again). Only where every reader takes this pool's lock
     * first: the relaxed mode, or the exact one while the pool is its
     * device's only one (stats_solo). */
    bool held_stats;
    /* true: the held block stayed in the pointer map (solo mode: the map's lock is this
     * pool's), not allocated, so no lookup finds it; pool_flush takes it out */
    bool held_in_map;
    /* allocations again of a held block not yet counted (pool_flush counts them): each the
     * same update as the last full one (ops_apply_again): a block of again_size bytes, an
     * upper neighbour of again_up, split or not, requested again_req bytes before and after
     * (never oversize: held_fit holds none), with no other statistics
     * update of the stream pool since (again_pool), so values and peaks stay and only the
     * counts move */
    uint64_t again_n;
    const struct cca_block *again_block; /* the held block the record was last used for */
    size_t again_size;
    size_t again_up;
    size_t again_req;
    bool again_split;
    /* held_fit's last yes: for this held block, size and bins version (nothing else moves it) */
    const struct cca_block *fit_block;
    size_t fit_size;
    uint64_t fit_version;
    /* the held block, when its next allocation of the size it had is the again update above
     * as it stands (its free's statistics held, in the pointer map, held_fit's yes cached):
     * the express pair's (cca_malloc) check; written at every hold */
    _Atomic(const struct cca_block *) express; /* read without the lock as a hint */
    cca_bins_t bins;
    struct cca_plan *plan;        /* compact_memory: the large pool's planned placement (plan.c) */
} cca_pool_t;

typedef struct cca_stream_pool {
    cca_spinlock_t lock;        /* guards both pools' bins, their blocks, the spares */
    /* the address of the block a pool of it handed out last: the express free's hint,
     * read without the lock (checked under it) */
    _Atomic uintptr_t last_addr;
    cca_stream_t stream;
    struct cca_device *device;
    struct cca_private_pool *private_pool; /* the private pool it belongs to; NULL: default */
    cca_pool_t small;
    cca_pool_t large;
    cca_block_t *spare_blocks;  /* recycled block structs (linked by bin_next) */
    size_t spare_count;
    cca_device_stats_t stats;   /* per-operation statistics when !exact_stats (pool lock) */
    /* the pool whose last ops_apply_again was this stream pool's last statistics update (its
     * repeats may be counted later: again_n); NULL after any other (ops_apply) */
    cca_pool_t *again_pool;
    /* the block of the last repeat counted in again_n, or NULL (a full update clears it):
     * only read while again_pool is set, that is with no other statistics update of this
     * stream pool since, so no block of it merged, split or freed (each updates them) and
     * the block still allocated unless held; its free, with no block held, is held back
     * as the free before its repeat was (free_express) */
    cca_block_t *rehold;
    /* compact_memory: which free blocks the stream's work is done with (pool lock) */
    uint64_t free_tick;         /* blocks returned to the pool so far */
    uint64_t ready_tick;        /* blocks returned at or before this tick: their work is done */
    uint64_t event_tick;        /* free_tick when ready_event was last recorded */
    uint64_t ready_stamp;       /* the device's compact_lends when readiness was last asked */
    cca_event_t ready_event;    /* recorded on the stream by growths; NULL until the first */
    bool event_pending;         /* ready_event recorded, not yet seen complete */
    /* exact mode beside other pools: the log of its operations' statistics (stats.c);
     * NULL until its first logged operation */
    struct stats_log *log;
    int log_slot;               /* its index in the device's ops->logs; -1: none yet,
                                   -2: none to be had (it applies its updates under the
                                   stats lock instead) */
} cca_stream_pool_t;

/*
 * One operation's statistics, logged by its stream pool with the time it was
 * made (stats_log_append): d[] of OPS_ALLOCATED_BYTES, ACTIVE_BYTES,
 * REQUESTED_BYTES, INACTIVE_SPLIT_BYTES in bytes, of OPS_ALLOCATION, ACTIVE,
 * INACTIVE_SPLIT, OVERSIZE in counts (a block or two each), and which way
 * the caller's signs say each goes: bit i of up (i < 4: bytes[i], else
 * counts[i - 4]) if the update raises that statistic (its peak to check, its
 * allocated count) rather than lowers it (its freed count). One cache line.
 */
typedef struct stats_entry {
    _Alignas(64) uint64_t time; /* CLOCK_MONOTONIC, ns; strictly rising in one log */
    int64_t bytes[4];
    int8_t counts[4];
    uint8_t up;
    int32_t type;
} stats_entry_t;

#define STATS_LOG_ENTRIES 256   /* a power of two */
#define STATS_LOG_SLOTS 256

/*
 * A stream pool's log: written under its pool's lock, read and emptied by
 * whoever merges under the stats lock (stats_merge). The producer's line,
 * the merger's line, then the entries.
 */
typedef struct stats_log {
    _Alignas(64) _Atomic uint64_t tail; /* entries written so far */
    _Atomic int stamping;       /* 1 from before an entry's time is read to after it is in */
    uint64_t last_time;
    uint64_t head_seen;         /* the producer's last look at head */
    _Alignas(64) _Atomic uint64_t head; /* entries merged so far */
    stats_entry_t e[STATS_LOG_ENTRIES];
} stats_log_t;

/* A pending record_stream event. */
typedef struct cca_pending_event {
    cca_event_t event;
    cca_block_t *block;
    cca_stream_t stream;        /* the stream it was recorded on */
    struct cca_pending_event *next;
} cca_pending_event_t;

/* What a route matches (private_pools.c). */
enum { CCA_ROUTE_FILTER = 0, CCA_ROUTE_STREAM = 1, CCA_ROUTE_THREAD = 2 };

/* A private pool (PyTorch's PrivatePool; private_pools.c). Device lock. */
typedef struct cca_private_pool {
    cca_mempool_id_t id;
    int use_count;              /* graphs, MemPools and routes holding it; 0: freeable */
    size_t segment_count;       /* its segments not yet freed (PyTorch's cudaMalloc_count) */
    bool no_split;              /* never split its blocks (MemPool no_split) */
    bool use_on_oom;            /* may serve default-pool allocations about to fail */
    cca_pool_alloc_fn user_alloc; /* non-NULL: its segments come from here (MemPool(allocator=)) */
    cca_pool_free_fn user_free;
    void *user_ctx;
    _Atomic int pins;           /* allocations routed to it, in flight */
    struct cca_stream_pool **stream_pools; /* one per stream used, sorted by stream */
    size_t stream_pool_count, stream_pool_cap;
    struct cca_private_pool *next; /* the device's pools, in creation order */
} cca_private_pool_t;

/* Allocations matching it go to a private pool (PyTorch's captures_underway entry). */
typedef struct cca_route {
    cca_mempool_id_t id;
    cca_private_pool_t *pool;
    int kind;                   /* CCA_ROUTE_* */
    cca_stream_filter_fn filter;/* CCA_ROUTE_FILTER */
    void *arg;
    cca_stream_t stream;        /* CCA_ROUTE_STREAM */
    pthread_t thread;           /* CCA_ROUTE_THREAD */
} cca_route_t;

/* A stream recorded on a block while a route was active. */
typedef struct cca_capture_use {
    struct cca_block *block;
    cca_stream_t stream;
} cca_capture_use_t;

/* The free markers of a set-aside free (graph_capture_record_stream_reuse; events.c). */
typedef struct cca_free_markers {
    struct cca_block *block;
    cca_graph_node_t *nodes;    /* the capture's terminal nodes of every stream that used it */
    size_t count;
} cca_free_markers_t;

/* Nodes found behind a capturing stream's terminals, per (capture, stream) (events.c). */
typedef struct cca_reuse_ctx {
    uint64_t capture_id;
    cca_stream_t stream;
    cca_graph_node_t *visited;  /* open-addressing set, NULL = empty slot */
    size_t cap, count;
} cca_reuse_ctx_t;

/* A registered callback (free-memory callbacks, OOM observers). */
typedef struct cca_callback {
    void *fn;
    void *arg;
} cca_callback_t;

typedef struct cca_device {
    int index;
    pthread_mutex_t lock;       /* device lock: segments, release paths, events */
    size_t total_memory;        /* bytes, from the backend */

    /* stream pools: an open-addressing table read without the device lock */
    _Atomic(cca_stream_pool_t *) *pool_table;
    size_t pool_table_cap;      /* power of two */
    size_t pool_count;
    _Atomic(cca_stream_pool_t *) default_pool; /* stream NULL */

    /* segments */
    cca_segment_t *segments;    /* list of live segments */
    size_t segment_count;
    size_t total_allocated_memory; /* bytes reserved from the backend (device lock) */

    /* expandable segments (expandable.c) */
    size_t vmm_granularity;     /* backend's granularity, bytes (0: not asked yet) */
    struct cca_vmm_orphan *orphans; /* granules whose unmap or release failed, retried later */
    size_t orphan_count, orphan_cap;
    /* compact_memory: handles unmapped for a growth in progress (empty between calls) */
    cca_phys_handle_t *lent;
    size_t lent_count, lent_cap;
    uint64_t compact_moves;     /* growths served (partly) by unmapped free granules */
    uint64_t compact_lends;     /* calls looking for free granules to lend */
    uint64_t compact_pending_growths; /* growths that mapped new memory, free granules pending */
    uint64_t compact_syncs;     /* stream synchronisations after a failed event call */
    uint64_t compact_moved_bytes; /* bytes moved that way */
    /* compact_memory: blocks whose granules a growth of their own stream maps again while the
     * stream's work on them is pending (their handles mapped at two addresses); the old
     * mappings are unmapped once the stream's event says the work is done (compact.c) */
    struct cca_block *aliased;  /* those blocks, linked by bin_next / bin_prev */
    size_t aliased_bytes;       /* bytes of their old mappings */
    uint64_t compact_aliased_bytes; /* bytes mapped again that way (part of compact_moved_bytes) */
    size_t compact_high;        /* the most reserved bytes after any expandable growth, plus
                                   the bytes aliased since and an eighth of those moved
                                   (compact.c: compact_limit) */
    size_t compact_requested;   /* the most requested bytes seen at a growth that could alias,
                                   since the last cca_empty_cache */
    int64_t compact_stale_peak; /* requested_bytes' peak at the last cca_empty_cache (0: none):
                                   while the peak is still that one, it is not this phase's */
    bool compact_held_back;     /* the growth under way left free granules in place (the limit) */
    bool compact_capped;        /* the growth under way met the limit at its cap */
    bool compact_planned;       /* a plan has started on the device (plan.c; device lock) */
    bool compact_unlimited;     /* the growth under way moves free granules whatever the limit */

    /* memory fraction */
    bool set_fraction;
    size_t allowed_memory_maximum; /* bytes */

    /* gc: get_free_block calls per kind while gc is on */
    _Atomic int64_t gc_calls_small;
    _Atomic int64_t gc_calls_large;

    /* record_stream events waiting for completion, in order; and the event
     * pool: guarded by events_lock, a leaf lock */
    pthread_mutex_t events_lock;
    cca_pending_event_t *events_head, *events_tail;
    _Atomic size_t pending_event_count;
    /* callers recording or querying stream events without the device lock, in flight
     * (events_enter): a route's begin waits for them */
    _Atomic uint32_t event_callers;
    /* private pools (private_pools.c): routes and pools under the device lock;
     * route_count is read without it on the allocation path */
    _Atomic uint32_t route_count;
    _Atomic uint32_t deferred_count; /* frees set aside during routes (events_lock) */
    cca_block_t *deferred_head;      /* linked by bin_next */
    cca_route_t *routes;             /* in begin order; the newest match wins */
    size_t route_cap;
    cca_private_pool_t *private_pools;
    cca_capture_use_t *capture_uses; /* (events_lock) */
    size_t capture_use_count, capture_use_cap;
    _Atomic bool capture_uses_present;
    cca_free_markers_t *markers;     /* (events_lock) */
    size_t marker_count, marker_cap;
    cca_reuse_ctx_t *reuse;          /* (device lock) */
    size_t reuse_count, reuse_cap;
    cca_event_t *event_pool;    /* reusable events */
    size_t event_pool_count, event_pool_cap;
    size_t events_created;      /* live events owned (pooled + pending) */

    /* stats */
    bool exact_stats;           /* settings.exact_peak_stats at init */
    cca_device_stats_t stats;   /* exact: the per-operation statistics' current and peak
                                   values are in ops; the rest here (stats lock: ops->lock) */
    struct ops_table *ops;      /* the stats lock; exact mode's values (see ops_apply) */
    /* the device's only stream pool, whose lock alone guards the ops table while it stays the
     * only one (set for the first default pool, cleared under its lock by a second; pool.c) */
    _Atomic(struct cca_stream_pool *) stats_solo;
    bool stats_solo_done;       /* a stream pool was created (device lock) */

    /* bit p: device p may access this device's memory; ranges mapped later get
     * its access (peer.c; bits only added, under the device lock) */
    _Atomic uint64_t peer_mask;
} cca_device_t;

#include "plan.h" /* compact_memory's planned placement */

/* The allocator, one per process. */
struct cca_settings_kept;
typedef struct cca_state {
    cca_backend_t *backend;
    /* The settings, immutable: cca_set_settings replaces them whole (a kept object, under
     * every device and stream pool lock), so a reader without a lock loads this once and
     * reads one consistent set, valid while the state lives. */
    const cca_settings_t *_Atomic settings;
    struct cca_settings_kept *settings_kept; /* every settings object made (setup.c) */
    bool no_caching;            /* CCA_NO_CACHING: every allocation to the backend */
    int device_count;
    cca_device_t *devices;

    /* pointer map: sharded hash of live (allocated or pending) blocks */
    struct cca_ptrmap *ptrmap;

    pthread_mutex_t callbacks_lock;
    cca_callback_t *free_callbacks;
    size_t free_callback_count;
    cca_callback_t *oom_observers;
    size_t oom_observer_count;
} cca_state_t;

extern CCA_HIDDEN cca_state_t *cca_state;

/* ---- ptrmap.c -------------------------------------------------------------- */

struct cca_ptrmap;
cca_status_t ptrmap_create(struct cca_ptrmap **out, void (*solo_end)(cca_spinlock_t *solo));
void ptrmap_destroy(struct cca_ptrmap *m);
/* A stream pool was made (its lock; NULL for one that may not guard the map, a private
 * pool's): the first starts solo mode, the second ends it, calling first, under the solo
 * lock, the map's solo_end function (given to ptrmap_create) with that lock. */
void ptrmap_pool_made(struct cca_ptrmap *m, cca_spinlock_t *pool_lock);
/* A stream pool is freed (its lock): solo mode ends if it was its pool's. */
void ptrmap_pool_gone(struct cca_ptrmap *m, cca_spinlock_t *pool_lock);
/* What the hot path reads of the map (its first member). */
struct cca_ptrmap_head {
    _Atomic(cca_spinlock_t *) solo; /* the only stream pool's lock; NULL: the shards' */
};
/* In solo mode, the only stream pool's lock, taken (then no shard lock is needed while it
 * is held), *entered how (cca_spin_enter); else NULL, nothing taken. */
static inline __attribute__((always_inline)) cca_spinlock_t *ptrmap_solo_enter(struct cca_ptrmap *m,
                                                                               int *entered)
{
    struct cca_ptrmap_head *h = (struct cca_ptrmap_head *)(void *)m;
    cca_spinlock_t *solo = atomic_load_explicit(&h->solo, memory_order_acquire);
    if (!solo)
        return NULL;
    *entered = cca_spin_enter(solo);
    if (atomic_load_explicit(&h->solo, memory_order_relaxed) == solo)
        return solo;
    cca_spin_leave(solo, *entered); /* solo mode ended meanwhile */
    return NULL;
}
/* ptrmap_solo_enter for a caller that leaves with cca_spin_unlock. */
static inline cca_spinlock_t *ptrmap_solo_lock(struct cca_ptrmap *m)
{
    int entered;
    return ptrmap_solo_enter(m, &entered);
}
/* The solo mode's lock, not taken (for a caller holding every stream pool lock), or NULL. */
cca_spinlock_t *ptrmap_solo(struct cca_ptrmap *m);
/* Insert a block keyed by its address. Returns false on allocation failure. held: a
 * stream pool lock the caller holds (or NULL); _held calls take no lock it stands for. */
bool ptrmap_insert(struct cca_ptrmap *m, cca_block_t *block);
/* Make sure that inserting a block at addr cannot fail for want of host memory (the tables
 * it could go to have buckets; a table never gives them back). False: no host memory. */
bool ptrmap_reserve(struct cca_ptrmap *m, uintptr_t addr);
bool ptrmap_insert_held(struct cca_ptrmap *m, cca_block_t *block, const cca_spinlock_t *held);
/* Solo mode's lookup and unlink without a call, and an insert inline: ptrmap.h. */
/* Take block itself out of the map (a held block kept there; held: as for _held). */
void ptrmap_remove_block(struct cca_ptrmap *m, cca_block_t *block, const cca_spinlock_t *held);
/* Find a live block by its exact address (a pooled block not allocated, held back in solo
 * mode, is not found); remove it when remove is set. */
cca_block_t *ptrmap_find(struct cca_ptrmap *m, uintptr_t addr, bool remove);
cca_block_t *ptrmap_find_held(struct cca_ptrmap *m, uintptr_t addr, bool remove,
                              const cca_spinlock_t *held);
/* Find the live block containing addr (slow: scans; no stream pool lock held). */
cca_block_t *ptrmap_find_containing(struct cca_ptrmap *m, uintptr_t addr);
/* Call fn on every block (no locks taken by fn). */
void ptrmap_for_each(struct cca_ptrmap *m, void (*fn)(cca_block_t *, void *), void *arg,
                     const cca_spinlock_t *held);
size_t ptrmap_count(struct cca_ptrmap *m, const cca_spinlock_t *held);
/* Tests: as solo mode ends, every shard without buckets fails to get them (its blocks stay
 * in the solo table, which the shards' lookups look at last). */
void ptrmap_test_spill_no_memory(bool on);

/* ---- bins.c ---------------------------------------------------------------- */

/* (insert, remove and best fit: bins.h) */
/* Largest free block, or NULL. */
cca_block_t *bins_largest(const cca_bins_t *bins);
/* Visit every free block in (size, addr) order; fn may not modify the bins. */
void bins_for_each(const cca_bins_t *bins, void (*fn)(cca_block_t *, void *), void *arg);
/* Next block in (size, addr) order after b, or NULL. */
cca_block_t *bins_next(const cca_bins_t *bins, const cca_block_t *b);
cca_block_t *bins_prev(const cca_bins_t *bins, const cca_block_t *b);

/* ---- observe/stats_text.c: summary text and memory_stats keys --- */

/* Bit set of stat types to update: always ALL, plus the pool's kind. */
static inline void stat_increase(cca_stat_t *stat, int64_t amount)
{
    stat->current += amount;
    if (stat->current > stat->peak)
        stat->peak = stat->current;
    stat->allocated += amount;
}

static inline void stat_decrease(cca_stat_t *stat, int64_t amount)
{
    stat->current -= amount;
    stat->freed += amount;
}
/* Append the memory_summary text for stats. */
void stats_format_summary(const cca_device_stats_t *stats, int device, bool abbreviated,
                          cca_strbuf_t *out);
/* Fill PyTorch's flat memory_stats list (sorted keys). */
void stats_flatten(const cca_device_stats_t *stats, cca_stat_entry_t *out);
/*
 * The per-operation statistics (those a stream pool keeps when peaks are
 * sampled): the CCA_OP_STAT_ARRAYS arrays of *stats, in a fixed order, plus
 * oversize_allocations, which the caller handles by name.
 */
#define CCA_OP_STAT_ARRAYS 7
void stats_op_arrays(cca_device_stats_t *stats, cca_stat_t *out[CCA_OP_STAT_ARRAYS]);
/* PyTorch's format_size (used in the OOM message). */
void stats_format_size(size_t size, char *buf, size_t buflen);



/* ---- helpers shared by the device allocator's files ------------------------- */

static inline bool block_is_split(const cca_block_t *b)
{
    return b->prev || b->next;
}

/* The size a free block could grow to: its own and the unmapped run after it (PyTorch's
 * expandable best fit prefers the block that could grow least). */
static inline size_t block_expandable_size(const cca_block_t *b)
{
    return b->size + (b->next && !b->next->mapped ? b->next->size : 0);
}

static inline int pool_stat_type(bool is_small)
{
    return is_small ? CCA_STAT_SMALL_POOL : CCA_STAT_LARGE_POOL;
}

/* Update the ALL entry and the pool kind's entry of a statistic array. */
static inline void stat2_inc(cca_stat_t *arr, int type, int64_t amount)
{
    stat_increase(&arr[CCA_STAT_ALL], amount);
    stat_increase(&arr[type], amount);
}

static inline void stat2_dec(cca_stat_t *arr, int type, int64_t amount)
{
    stat_decrease(&arr[CCA_STAT_ALL], amount);
    stat_decrease(&arr[type], amount);
}

/*
 * The per-operation statistics (allocation, allocated_bytes, active,
 * active_bytes, requested_bytes, inactive_split, inactive_split_bytes, in
 * stats_op_arrays' order, then oversize_allocations, kept in the ALL row).
 * With exact_peak_stats their current and peak values live in the device's
 * ops table, by type then statistic, so an operation touches the two 128-byte
 * rows of ALL and of its pool's kind; allocated / freed go with them while the
 * device's statistics are locked, to the stream pool's own statistics once
 * they are shared.
 */
enum {
    OPS_ALLOCATION, OPS_ALLOCATED_BYTES, OPS_ACTIVE, OPS_ACTIVE_BYTES, OPS_REQUESTED_BYTES,
    OPS_INACTIVE_SPLIT, OPS_INACTIVE_SPLIT_BYTES, OPS_OVERSIZE, OPS_COUNT
};

typedef struct ops_count {
    int64_t allocated, freed;
} ops_count_t;

/*
 * The device's stats lock and exact mode's values, allocated 64-byte aligned
 * (pool_device_init) apart from the device's fields that every operation
 * reads. The lock's word has a cache line of its own, the merger's fields
 * (the table of stream pools' logs) another; each type's row of current values
 * is one line and its peaks another.
 */
typedef struct ops_table {
    _Alignas(64) cca_spinlock_t lock; /* the stats lock */
    /* the merger's (stats lock): the logs of stream pools that have logged, in slots
     * below log_count */
    _Alignas(64) _Atomic uint32_t log_count;
    uint64_t merged;            /* entries merged so far */
    _Atomic(stats_log_t *) logs[STATS_LOG_SLOTS];
    /* the merge's runs (stats lock): each log's entries up to the merge's time */
    struct stats_run {
        stats_log_t *log;
        uint64_t head, end;
        uint64_t time;          /* the head entry's */
    } runs[STATS_LOG_SLOTS];
    _Alignas(64) int64_t cur[CCA_STAT_TYPES][OPS_COUNT];
    int64_t peak[CCA_STAT_TYPES][OPS_COUNT];
    ops_count_t n[CCA_STAT_TYPES][OPS_COUNT]; /* allocated / freed */
} ops_table_t;

static inline bool stats_try_lock(cca_device_t *dev)
{
    return cca_spin_trylock(&dev->ops->lock);
}

/* The stats lock: the device's own statistics (segments, reserved, counters) and the ops
 * table; a reader of the table's values merges the logs first (stats_lock_merged). */
static inline void stats_lock(cca_device_t *dev)
{
    cca_spin_lock(&dev->ops->lock);
}

static inline void stats_unlock(cca_device_t *dev)
{
    cca_spin_unlock(&dev->ops->lock);
}

/* Every logged entry made before now into the ops table, in time order (stats lock held;
 * stats.c). After it the table holds the values of one order of all operations so far. */
void stats_merge(cca_device_t *dev);

/* The stats lock, the logs merged: the table is current (for its readers). */
static inline void stats_lock_merged(cca_device_t *dev)
{
    stats_lock(dev);
    stats_merge(dev);
}

/* The statistics array of stat in a cca_device_stats_t (oversize_allocations: one entry). */
static inline cca_stat_t *ops_array(cca_device_stats_t *s, int stat)
{
    switch (stat) {
    case OPS_ALLOCATION: return s->allocation;
    case OPS_ALLOCATED_BYTES: return s->allocated_bytes;
    case OPS_ACTIVE: return s->active;
    case OPS_ACTIVE_BYTES: return s->active_bytes;
    case OPS_REQUESTED_BYTES: return s->requested_bytes;
    case OPS_INACTIVE_SPLIT: return s->inactive_split;
    case OPS_INACTIVE_SPLIT_BYTES: return s->inactive_split_bytes;
    default: return &s->oversize_allocations;
    }
}

/*
 * How one operation's statistics are written (ops_apply):
 *   relaxed (exact_peak_stats:False, default pools): all in the stream pool's
 *     own statistics, plain; device values are summed on read, peaks sampled.
 *   locked (exact_peak_stats, the default, while the stream pool is its
 *     device's only one: stats_solo, the common single-thread case): the
 *     device's ops table (values and counts), plain, under nothing more than
 *     the pool's own lock, which orders every operation and every reader.
 *     Of the ALL entries only the peak is written, the rest is the sum of the
 *     two kinds' (stats_fill_ops).
 *   logged (exact_peak_stats beside other pools): the update goes into the
 *     stream pool's own log with the time it was made (stats_log_append), a
 *     line of the pool's own, no lock shared with another thread; whoever
 *     next takes the stats lock to read the table, or finds its log half
 *     full, merges every log's entries made before the moment it looks into
 *     the table, in time order (stats_merge). The table's values and peaks
 *     are those of the operations in the order of their times: one order,
 *     consistent with real time (an operation that ended before another began
 *     has the earlier time), so every peak is exact.
 */
enum { OPS_RELAXED, OPS_LOCKED, OPS_LOGGED };

/* The only pool's lock, for readers of the ops table (then the stats lock); NULL if none. */
void pool_flush(struct cca_stream_pool *sp);

/* Whether pool_flush has anything to do: a held block, repeats not yet counted, or a last
 * update a repeat could still follow (a reader may reset peaks: repeats then count in full). */
static inline bool pool_pending(const struct cca_stream_pool *sp)
{
    return sp->small.held || sp->large.held || sp->small.again_n || sp->large.again_n ||
           sp->again_pool;
}

static inline struct cca_stream_pool *stats_solo_lock(cca_device_t *dev)
{
    struct cca_stream_pool *solo = atomic_load_explicit(&dev->stats_solo, memory_order_acquire);
    if (solo) {
        cca_spin_lock(&solo->lock); /* it lives until shutdown, cleared or not */
        if (pool_pending(solo))
            pool_flush(solo); /* its held-back free's statistics applied, its repeats counted */
    }
    return solo;
}

static inline void stats_solo_unlock(struct cca_stream_pool *solo)
{
    if (solo)
        cca_spin_unlock(&solo->lock);
}

/* How sp's operation writes its statistics (pool lock held). */
static inline int op_stats_mode(const cca_stream_pool_t *sp)
{
    cca_device_t *dev = sp->device;
    if (!dev->exact_stats && !sp->private_pool) /* private pools: always the device's */
        return OPS_RELAXED;
    if (atomic_load_explicit(&dev->stats_solo, memory_order_relaxed) == sp)
        return OPS_LOCKED; /* the device's only pool: its own lock (held) orders all */
    return OPS_LOGGED;
}

/*
 * Add amount (non-zero; negative: take away) to one statistic of one type, in
 * mode; sign: 1 or -1 when the caller knows amount's sign (amount may then be
 * 0: the update changes nothing), 0 when not. t: the
 * device's ops table; own: the stream pool's statistics.
 */
static inline __attribute__((always_inline)) void ops_add(ops_table_t *t, cca_device_stats_t *own,
                                                          int mode, int stat, int type,
                                                          int64_t amount, int sign)
{
    bool up = sign > 0 || (sign == 0 && amount > 0);
    if (mode == OPS_RELAXED) {
        cca_stat_t *acc = &ops_array(own, stat)[type];
        acc->current += amount;
        if (up) {
            if (acc->current > acc->peak)
                acc->peak = acc->current;
            acc->allocated += amount;
        } else {
            acc->freed -= amount;
        }
        return;
    }
    int64_t *cur = &t->cur[type][stat], *peak = &t->peak[type][stat];
    ops_count_t *n = &t->n[type][stat];
    *cur += amount; /* locked: one writer at a time, every reader behind the same lock */
    if (up) {
        if (*cur > *peak)
            *peak = *cur;
        n->allocated += amount;
    } else {
        n->freed -= amount;
    }
}

/*
 * The locked mode's update (ops_apply_mode) with the rows of the pool's kind
 * given: its current values, peaks and counts, and the other kind's current
 * values. Indexed through the table at every statistic, a row's address was
 * computed anew for each (a row is 64 or 128 bytes, more than an address's
 * scale); a pool keeps its rows (ops_cur ...), so ops_apply reads them.
 */
static inline __attribute__((always_inline)) void ops_apply_rows(ops_table_t *t, int64_t *cur,
                                                                 int64_t *peak, ops_count_t *n,
                                                                 const int64_t *other,
                                                                 const int64_t d[OPS_COUNT],
                                                                 const int8_t sign[OPS_COUNT])
{
#pragma GCC unroll 8
    for (int k = 0; k < OPS_OVERSIZE; k++) {
        if (!sign[k] && !d[k]) /* a known sign: the update runs even for 0, a no-op */
            continue;
        int64_t c = cur[k] + d[k]; /* one writer at a time, every reader behind the same lock */
        cur[k] = c;
        if (sign[k] > 0 || (sign[k] == 0 && d[k] > 0)) {
            if (c > peak[k])
                peak[k] = c;
            n[k].allocated += d[k];
            /* the ALL entry is the two kinds' sum (stats_fill_ops); only its peak is
             * kept, raised from the sum this update produced */
            int64_t all = c + other[k];
            if (all > t->peak[CCA_STAT_ALL][k])
                t->peak[CCA_STAT_ALL][k] = all;
        } else {
            n[k].freed -= d[k];
        }
    }
    if (sign[OPS_OVERSIZE] || d[OPS_OVERSIZE])
        ops_add(t, NULL, OPS_LOCKED, OPS_OVERSIZE, CCA_STAT_ALL, d[OPS_OVERSIZE], sign[OPS_OVERSIZE]);
}

/*
 * d[k] added to statistic k of type's entry and of the ALL entry (the relaxed
 * mode: own's; the locked mode: the table's). sign[k]: d[k]'s sign where the
 * caller knows it, else 0 (ops_apply); a known sign updates even for 0, and
 * says which way the update goes, else the amount's sign does. The callers'
 * constant signs fold most of the branches away here, and the rest measured
 * cheaper than the merge's straight line (stats.c, stats_entry_apply) on a
 * random workload on one thread (75 against 79 ns a step); the merge, whose
 * entries come with no constant sign, takes the straight line.
 */
static inline __attribute__((always_inline)) void ops_apply_mode(ops_table_t *t,
                                                                 cca_device_stats_t *own,
                                                                 int mode, int type,
                                                                 const int64_t d[OPS_COUNT],
                                                                 const int8_t sign[OPS_COUNT])
{
    if (mode == OPS_LOCKED) {
        ops_apply_rows(t, t->cur[type], t->peak[type], t->n[type],
                       t->cur[CCA_STAT_SMALL_POOL + CCA_STAT_LARGE_POOL - type], d, sign);
        return;
    }
#pragma GCC unroll 8
    for (int k = 0; k < OPS_COUNT; k++) {
        if (!sign[k] && !d[k]) /* a known sign: the update runs even for 0, a no-op */
            continue;
        ops_add(t, own, mode, k, CCA_STAT_ALL, d[k], sign[k]);
        if (k != OPS_OVERSIZE)
            ops_add(t, own, mode, k, type, d[k], sign[k]);
    }
}

/* A log entry's update from an operation's d and sign, as ops_apply takes them (stats.c). */
void stats_entry_fill(stats_entry_t *e, int type, const int64_t d[OPS_COUNT],
                      const int8_t sign[OPS_COUNT]);
/* A log entry into the table: the values ops_apply_mode's locked mode gives the same
 * update (stats lock held; stats.c). */
void stats_entry_apply(ops_table_t *t, const stats_entry_t *e);

/* Take sp's log out of its device's table, its entries merged, and free it (before sp
 * is freed; stats.c). */
void stats_log_release(cca_stream_pool_t *sp);

/* Whether pools may log (the clock fine and cheap enough): 0 asks the clock again, 1 yes,
 * 2 no (tests; stats.c). */
void stats_clock_set_usable(int usable);
/* Whether n clock reads taken in a row show a clock fine enough to order the logs' entries:
 * each later than the one before (no tick spans a read), most of them under 500 ns apart (stats.c). */
bool stats_clock_reads_fine(const uint64_t *reads, size_t n);

/* An operation's d (ops_apply) by value: the logged mode's copy, so that ops_apply's d
 * itself never needs a place in memory and stays in registers on the other modes' paths. */
typedef struct ops_delta {
    int64_t v[OPS_COUNT];
} ops_delta_t;

/* Log the update, with the time it is made, in sp's log (pool lock held; stats.c); with
 * no log to be had, apply it under the stats lock. */
void stats_log_append(cca_stream_pool_t *sp, int type, ops_delta_t d, const int8_t sign[OPS_COUNT]);

/*
 * One operation's statistics: d[k] added to statistic k (OPS_*), in the ALL
 * entry and in the entry of the pool's kind, in one update (stream pool lock
 * held, so one pool's updates land in its lock order). sign[k]: d[k]'s sign
 * where the caller knows it (a constant array), else 0.
 */
static inline __attribute__((always_inline)) void ops_apply(cca_pool_t *pool, const int64_t d[OPS_COUNT],
                                                            const int8_t sign[OPS_COUNT])
{
    cca_stream_pool_t *sp = pool->owner;
    int type = pool_stat_type(pool->is_small);
    int mode = op_stats_mode(sp);
    cca_device_t *dev = sp->device;
    sp->again_pool = NULL;
    if (mode == OPS_LOCKED) {
        ops_apply_rows(dev->ops, pool->ops_cur, pool->ops_peak, pool->ops_n, pool->ops_other, d, sign);
    } else if (mode == OPS_LOGGED) {
        if (!sp->log && atomic_load_explicit(&dev->ops->log_count, memory_order_acquire) == 0 &&
            stats_try_lock(dev)) {
            /* no thread has logged yet (none has met another on the stats lock): the
             * update goes into the table under the lock, as it happens. A log entered
             * since has its entries' times after the load above, merged after this. */
            ops_apply_mode(dev->ops, NULL, OPS_LOCKED, type, d, sign);
            stats_unlock(dev);
        } else {
            ops_delta_t copy;
#pragma GCC unroll 8
            for (int k = 0; k < OPS_COUNT; k++)
                copy.v[k] = d[k];
            stats_log_append(sp, type, copy, sign);
        }
    } else {
        ops_apply_mode(NULL, &sp->stats, OPS_RELAXED, type, d, sign);
    }
}

/* Whether sp may keep a held-back free's statistics unapplied (held_stats; pool lock held). */
static inline bool ops_may_defer(const cca_stream_pool_t *sp)
{
    cca_device_t *dev = sp->device;
    if (sp->private_pool)
        return false;
    if (!dev->exact_stats)
        return true; /* relaxed: readers sum the pools under their locks */
    return atomic_load_explicit(&dev->stats_solo, memory_order_relaxed) == sp;
}

/* One statistic moved by a, then by b, as two ops_add of the relaxed mode would. */
static inline __attribute__((always_inline)) void stat_move2(cca_stat_t *st, int64_t a, int64_t b)
{
    int64_t mid = st->current + a, end = mid + b;
    if (a > 0) {
        st->allocated += a;
        if (mid > st->peak)
            st->peak = mid;
    } else {
        st->freed -= a;
    }
    if (b > 0) {
        st->allocated += b;
        if (end > st->peak)
            st->peak = end;
    } else {
        st->freed -= b;
    }
    st->current = end;
}

/* The same for the locked mode's table entries. */
static inline __attribute__((always_inline)) void ops_move2(int64_t *cur, int64_t *peak,
                                                            ops_count_t *n, int64_t a, int64_t b)
{
    int64_t mid = *cur + a, end = mid + b;
    if (a > 0) {
        n->allocated += a;
        if (mid > *peak)
            *peak = mid;
    } else {
        n->freed -= a;
    }
    if (b > 0) {
        n->allocated += b;
        if (end > *peak)
            *peak = end;
    } else {
        n->freed -= b;
    }
    *cur = end;
}

/*
 * The statistics of a held-back free (held_stats) and of the held block's
 * allocation again, in one update (pool lock held; the modes of
 * ops_may_defer). size: the block's bytes; up: its free upper neighbour's;
 * split: the merged block was a piece of a split segment; old_req, new_req:
 * the two requests' sizes. The same as pool_free_block's update followed by
 * alloc_account's: allocation, allocated_bytes, active, active_bytes,
 * oversize and inactive_split come back to their values (their counts move,
 * and inactive_split_bytes' peak may rise in between, by size, when split),
 * requested_bytes moves by new_req - old_req.
 */
static inline __attribute__((always_inline)) void ops_apply_again(cca_stream_pool_t *sp, int type,
                                                                  int64_t size, int64_t up, bool split,
                                                                  bool oversize, int64_t old_req,
                                                                  int64_t new_req)
{
    cca_device_t *dev = sp->device;
    int other = type == CCA_STAT_SMALL_POOL ? CCA_STAT_LARGE_POOL : CCA_STAT_SMALL_POOL;
    if (!dev->exact_stats) {
        cca_device_stats_t *own = &sp->stats;
        for (int row = 0; row < 2; row++) {
            int ty = row ? type : CCA_STAT_ALL;
            own->allocation[ty].allocated++;
            own->allocation[ty].freed++;
            own->active[ty].allocated++;
            own->active[ty].freed++;
            own->allocated_bytes[ty].allocated += size;
            own->allocated_bytes[ty].freed += size;
            own->active_bytes[ty].allocated += size;
            own->active_bytes[ty].freed += size;
            stat_move2(&own->requested_bytes[ty], -old_req, new_req);
            if (split) {
                stat_move2(&own->inactive_split_bytes[ty], size, -size);
            } else {
                own->inactive_split[ty].allocated++;
                own->inactive_split[ty].freed++;
                own->inactive_split_bytes[ty].allocated += up;
                own->inactive_split_bytes[ty].freed += up;
            }
        }
        if (oversize) {
            own->oversize_allocations.allocated++;
            own->oversize_allocations.freed++;
        }
        return;
    }
    ops_table_t *t = dev->ops; /* locked, the only pool: its lock orders every reader */
    ops_count_t *n = t->n[type];
    n[OPS_ALLOCATION].allocated++;
    n[OPS_ALLOCATION].freed++;
    n[OPS_ACTIVE].allocated++;
    n[OPS_ACTIVE].freed++;
    n[OPS_ALLOCATED_BYTES].allocated += size;
    n[OPS_ALLOCATED_BYTES].freed += size;
    n[OPS_ACTIVE_BYTES].allocated += size;
    n[OPS_ACTIVE_BYTES].freed += size;
    ops_move2(&t->cur[type][OPS_REQUESTED_BYTES], &t->peak[type][OPS_REQUESTED_BYTES],
              &n[OPS_REQUESTED_BYTES], -old_req, new_req);
    if (new_req > old_req) {
        int64_t all = t->cur[type][OPS_REQUESTED_BYTES] + t->cur[other][OPS_REQUESTED_BYTES];
        if (all > t->peak[CCA_STAT_ALL][OPS_REQUESTED_BYTES])
            t->peak[CCA_STAT_ALL][OPS_REQUESTED_BYTES] = all;
    }
    if (split) {
        ops_move2(&t->cur[type][OPS_INACTIVE_SPLIT_BYTES], &t->peak[type][OPS_INACTIVE_SPLIT_BYTES],
                  &n[OPS_INACTIVE_SPLIT_BYTES], size, -size);
        int64_t all = t->cur[type][OPS_INACTIVE_SPLIT_BYTES] + t->cur[other][OPS_INACTIVE_SPLIT_BYTES] +
                      size;
        if (all > t->peak[CCA_STAT_ALL][OPS_INACTIVE_SPLIT_BYTES])
            t->peak[CCA_STAT_ALL][OPS_INACTIVE_SPLIT_BYTES] = all;
    } else {
        n[OPS_INACTIVE_SPLIT].allocated++;
        n[OPS_INACTIVE_SPLIT].freed++;
        n[OPS_INACTIVE_SPLIT_BYTES].allocated += up;
        n[OPS_INACTIVE_SPLIT_BYTES].freed += up;
    }
    if (oversize) {
        t->n[CCA_STAT_ALL][OPS_OVERSIZE].allocated++;
        t->n[CCA_STAT_ALL][OPS_OVERSIZE].freed++;
    }
}

/* Count pool's repeats of its last full ops_apply_again (pool lock held). */
void pool_flush_agains(cca_pool_t *pool);
/* The counts of n repeats of one ops_apply_again (old_req == new_req == req) whose values
 * and peaks were those of the first (pool_flush; pool lock held). */
void ops_again_counts(cca_stream_pool_t *sp, int type, uint64_t n, int64_t size, int64_t up,
                      bool split, int64_t req);

/* ---- pool.c: blocks, stream pools, device set-up ------------------------------ */

/* A block struct of the heap (pool_block_new's, when the pool has no spare); NULL: none. */
cca_block_t *pool_block_struct(void);
/* Tests: the n-th host allocation from now among the stream pools' block structs, the
 * pointer map's buckets, a block's record_stream streams and a checkpoint restore's lists
 * fails (0: none), as it would with the host out of memory; pool_host_alloc_fails asks
 * before each. */
void pool_test_fail_host_alloc(long n);
/* Tests: with off, compact_memory's growths move free granules known done whatever the limit
 * (compact.c: lend_free_granules), so a threaded test moves granules at every growth. */
void compact_test_limit(bool off);
/* Tests: with on, the device's room for orphan records cannot grow, as with the host out of
 * memory. */
void expandable_test_fail_orphan_room(bool on);
bool pool_host_alloc_fails(void);
/* At least n block structs among sp's spares, so that n splits cannot fail for want of
 * host memory (pool lock held). False: no host memory (those made are kept). */
bool pool_spares_reserve(cca_stream_pool_t *sp, size_t n);

/*
 * A block struct from the stream pool's spares, or a new one (pool lock
 * held); NULL: no host memory. Every field is set here, explicitly (a memset
 * of the whole struct showed up as the top cost of the split path): a new
 * field must be too. Inline: the allocation's split makes one.
 */
static inline cca_block_t *pool_block_new(cca_pool_t *pool, cca_segment_t *seg, uintptr_t addr,
                                          size_t size)
{
    cca_stream_pool_t *sp = pool->owner;
    cca_block_t *b = sp->spare_blocks;
    if (b) {
        sp->spare_blocks = b->bin_next;
        sp->spare_count--;
    } else if (!(b = pool_block_struct())) {
        return NULL;
    }
    b->addr = addr;
    b->size = size;
    b->requested_size = 0;
    b->prev = b->next = NULL;
    b->bin_prev = b->bin_next = NULL;
    b->map_next = NULL;
    b->pool = pool;
    b->segment = seg;
    b->gc_count_base = 0;
    b->free_tick = 0;
    b->event_count = 0;
    b->bin = 0;
    b->allocated = false;
    b->in_bin = false;
    b->oversize = false;
    b->mapped = true;
    b->aliased = false;
    b->plan_serial = 0;
    b->stream_use_count = 0;
    b->stream_use_cap = 0;
    b->stream_uses = NULL;
    return b;
}

/* Give a block struct back to its stream pool's spares (pool lock held; inline: a free's
 * merge gives one back). */
static inline void pool_block_delete(cca_block_t *b)
{
    if (b->stream_uses) {
        free(b->stream_uses);
        b->stream_uses = NULL;
    }
    cca_stream_pool_t *sp = b->pool->owner;
    if (b->pool->last_alloc == b)
        b->pool->last_alloc = NULL;
    if (b->pool->fit_block == b)
        b->pool->fit_block = NULL;
    if (sp->spare_count >= 4096) {
        free(b);
        return;
    }
    b->bin_next = sp->spare_blocks;
    sp->spare_blocks = b;
    sp->spare_count++;
}
/* The calling thread's last stream pool, valid while the state generation is unchanged. */
typedef struct pool_cache {
    uint64_t generation;
    int device_index;     /* device's index: a valid one while generation is current */
    cca_device_t *device;
    cca_stream_t stream;
    cca_stream_pool_t *pool;
} pool_cache_t;
extern CCA_HIDDEN CCA_THREAD_HOT pool_cache_t pool_cache;
extern CCA_HIDDEN _Atomic uint64_t state_generation; /* advanced by each device set-up and shutdown */
cca_stream_pool_t *pool_stream_get_slow(cca_device_t *dev, cca_stream_t stream);

/* The pool of (device, stream), created on first use. NULL: out of host memory or streams. */
static inline cca_stream_pool_t *pool_stream_get(cca_device_t *dev, cca_stream_t stream)
{
    if (pool_cache.device == dev && pool_cache.stream == stream &&
        pool_cache.generation == atomic_load_explicit(&state_generation, memory_order_relaxed))
        return pool_cache.pool;
    return pool_stream_get_slow(dev, stream);
}
/* A stream pool outside the device's table (a private pool's); NULL: no host memory. */
cca_stream_pool_t *pool_stream_pool_new(cca_device_t *dev, cca_stream_t stream);
/* Free such a stream pool and its spare block structs. */
void pool_stream_pool_delete(cca_stream_pool_t *sp);
/* Unlink and free a private pool holding no segment (device lock held). */
void pool_private_destroy(cca_device_t *dev, cca_private_pool_t *pp);
/* Stream pools of a device sorted by stream handle (device lock held); caller frees. */
cca_stream_pool_t **pool_sorted_locked(cca_device_t *dev, size_t *count);
/* Merge the free block src (if free) into dst; bytes subsumed, or 0 (stream pool lock held). */
size_t pool_try_merge_blocks(cca_block_t *dst, cca_block_t *src, cca_bins_t *bins);
/* Merge the blocks held back from merging in both pools of sp, their statistics
 * applied (its lock held). */
void pool_flush(cca_stream_pool_t *sp);
/* The pointer map's solo mode ends (the solo pool's lock, held): its held blocks out of it. */
void pool_solo_end(cca_spinlock_t *solo);

/* The stream pool whose lock is lock. */
static inline cca_stream_pool_t *pool_of_lock(cca_spinlock_t *lock)
{
    return (cca_stream_pool_t *)((char *)lock - offsetof(cca_stream_pool_t, lock));
}
/*
 * Whether block, just returned, may be held back from merging (pool lock
 * held, the pool's held block flushed): the block its pool handed out last
 * (the cached pair's; holding others would mostly cost a merge later), of a
 * default pool's plain segment, whose upper neighbour is free and whose lower
 * one is not, so the merge would only take in the upper one. A request of
 * the block's size that best fit would serve from the merged block then gets
 * it back as it is (alloc.c), the cached pair's split and merge never made.
 * Blocks of expandable segments too: anything that looks at their free
 * blocks or maps, unmaps or lends granules locks the pool with pool_lock.
 */
static inline bool pool_may_hold(const cca_pool_t *pool, const cca_block_t *block)
{
    const cca_block_t *next = block->next;
    return block == pool->last_alloc && next && next->in_bin &&
           !(block->prev && block->prev->in_bin) && !pool->owner->private_pool;
}
/* Lock a stream pool for anything but the cached pair: its held-back block
 * is merged first, so the caller sees the pool exactly as PyTorch's. */
static inline void pool_lock(cca_stream_pool_t *sp)
{
    cca_spin_lock(&sp->lock);
    if (pool_pending(sp))
        pool_flush(sp);
}

/* pool_lock for a caller that may hold sp's lock already (held): its held-back frees
 * merged either way; pool_unlock_unless_held after. */
static inline void pool_lock_unless_held(cca_stream_pool_t *sp, const cca_stream_pool_t *held)
{
    if (sp != held)
        cca_spin_lock(&sp->lock);
    if (pool_pending(sp))
        pool_flush(sp);
}

static inline void pool_unlock_unless_held(cca_stream_pool_t *sp, const cca_stream_pool_t *held)
{
    if (sp != held)
        cca_spin_unlock(&sp->lock);
}
/* Return a block to its pool: merge, bin, statistics (stream pool lock held). */
void pool_free_block(cca_device_t *dev, cca_block_t *block, bool program_free);
/* The statistics of a held-back return applied now (pool_hold_block; pool.c). */
void pool_hold_stats(cca_block_t *block, bool program_free);

/* What every return of a block starts with: the trace (pool_free_begin), the garbage
 * collector's age, the tick compact_memory's readiness goes by (pool_free_mark; stream pool
 * lock held). True for a block of an expandable segment. */
static inline __attribute__((always_inline)) bool pool_free_mark(cca_block_t *block)
{
    cca_pool_t *pool = block->pool;
    block->gc_count_base = atomic_load_explicit(pool->gc_calls, memory_order_relaxed);
    bool expandable = pool->expandable_segments && block->segment->es;
    if (expandable) /* the newest tick: a merge keeps the higher one (pool_try_merge_blocks) */
        block->free_tick = ++pool->owner->free_tick; /* compact_memory's readiness (compact.c) */
    return expandable;
}

static inline __attribute__((always_inline)) bool pool_free_begin(cca_device_t *dev, cca_block_t *block)
{
    trace_record_pool(dev->index, CCA_TRACE_FREE_COMPLETED, block->addr, block->requested_size,
                      block->pool->owner->stream,
                      (block->pool->owner->private_pool ? block->pool->owner->private_pool->id
                                                        : (cca_mempool_id_t){0, 0}));
    return pool_free_mark(block);
}

/* The signs of a block's return's statistics where known (pool_return_block, pool.c). */
static const int8_t pool_free_sign[OPS_COUNT] = {0, 0, -1, -1, -1, 0, 0, 0};
/* The same with the program's free in it (allocation and allocated_bytes known to fall: a
 * block's size is never 0), so that the update asks neither amount's sign nor whether it
 * is 0. Oversize stays unknown: mostly 0, skipped then. */
static const int8_t pool_program_free_sign[OPS_COUNT] = {-1, -1, -1, -1, -1, 0, 0, 0};

/* dst takes in src, its neighbour in the segment, taken out of every list before: src's
 * bytes and its place in the segment's block list (the caller gives src's struct back). */
static inline __attribute__((always_inline)) void pool_absorb_neighbour(cca_block_t *dst,
                                                                         const cca_block_t *src)
{
    if (dst->prev == src) {
        dst->addr = src->addr;
        dst->prev = src->prev;
        if (dst->prev)
            dst->prev->next = dst;
        else
            dst->segment->head = dst;
    } else {
        dst->next = src->next;
        if (dst->next)
            dst->next->prev = dst;
    }
    dst->size += src->size;
}

/* Link front, a new struct for the first front->size bytes of the free block b (out of its
 * bin), before b, which keeps the rest; front takes b's return tick and cache count and goes
 * into the bin (compact_memory: a block shifted to its granule, a planned place). Pool lock
 * held. */
static inline void pool_split_front(cca_pool_t *pool, cca_block_t *front, cca_block_t *b)
{
    front->prev = b->prev;
    if (front->prev)
        front->prev->next = front;
    else
        front->segment->head = front;
    front->next = b;
    b->prev = front;
    b->addr += front->size;
    b->size -= front->size;
    front->free_tick = b->free_tick;
    front->gc_count_base = b->gc_count_base;
    bins_insert(&pool->bins, front);
}

/* Undo pool_split_front: front (in its bin) and its next, out of its bin, one block again,
 * returned out of its bin. */
static inline cca_block_t *pool_join_front(cca_pool_t *pool, cca_block_t *front)
{
    cca_block_t *b = front->next;
    bins_remove(&pool->bins, front);
    pool_absorb_neighbour(b, front);
    pool_block_delete(front);
    return b;
}

/* Merge src into dst if src is free; returns the bytes subsumed (pool lock held). */
static inline __attribute__((always_inline)) size_t pool_merge_blocks(cca_block_t *dst, cca_block_t *src,
                                                                     cca_bins_t *bins)
{
    if (!src || !src->in_bin)
        return 0;
    bins_remove(bins, src);
    pool_absorb_neighbour(dst, src);
    if (src->free_tick > dst->free_tick)
        dst->free_tick = src->free_tick;
    size_t subsumed = src->size;
    pool_block_delete(src);
    return subsumed;
}

/* pool_free_block where the caller knows the pool holds no block back and pool_may_hold
 * says no for this one: merge with free neighbours, bin, statistics (stream pool lock held;
 * inline: a free's general path returns its block here). */
static inline __attribute__((always_inline)) void pool_return_block(cca_device_t *dev, cca_block_t *block,
                                                                    bool program_free)
{
    cca_pool_t *pool = block->pool;
    size_t original_size = block->size;
    size_t requested = block->requested_size;
    bool expandable = pool_free_begin(dev, block);
    int64_t net_blocks = 0, net_bytes = 0;
    cca_block_t *candidates[2] = {block->prev, block->next};
    for (int i = 0; i < 2; i++) {
        size_t subsumed = pool_merge_blocks(block, candidates[i], &pool->bins);
        if (subsumed) {
            net_blocks -= 1;
            net_bytes -= (int64_t)subsumed;
        }
    }
    bins_insert(&pool->bins, block);
    if (block_is_split(block)) {
        net_blocks += 1;
        net_bytes += (int64_t)block->size;
    }
    int64_t d[OPS_COUNT] = {0};
    if (program_free) {
        /* the program's free and the block's return in one statistics update */
        d[OPS_ALLOCATION] = -1;
        d[OPS_ALLOCATED_BYTES] = -(int64_t)original_size;
        d[OPS_OVERSIZE] = -(int64_t)block->oversize;
    }
    if (!expandable) { /* PyTorch keeps expandable blocks out of inactive_split */
        d[OPS_INACTIVE_SPLIT] = net_blocks;
        d[OPS_INACTIVE_SPLIT_BYTES] = net_bytes;
    }
    d[OPS_ACTIVE] = -1;
    d[OPS_ACTIVE_BYTES] = -(int64_t)original_size;
    d[OPS_REQUESTED_BYTES] = -(int64_t)requested;
    ops_apply(pool, d, program_free ? pool_program_free_sign : pool_free_sign);
}

/*
 * Whether the held block h's next allocation of the size it had would be the
 * again update of alloc.c's held path as the pool stands (stream pool lock
 * held): held_fit's yes cached for it with the bins unchanged since, the
 * pool's again record last used for h (its size, request, upper neighbour
 * and split: none of them moves while the bins stay, and the record stays
 * the stream pool's last update while again_pool says so, which the
 * allocation checks). Nothing changes the answer while h stays held: any
 * other use of the pool flushes h first.
 */
static inline bool pool_again_ready(const cca_pool_t *pool, const cca_block_t *h)
{
    return pool->again_block == h && pool->fit_block == h && pool->fit_version == pool->bins.version;
}

/* Hold block back from merging with its free's statistics put off: pool_flush applies them
 * (held_free_deltas), or the block's next allocation folds them into its own (alloc.c);
 * ready for the express allocation where it stays in the map and repeats the pool's last
 * update (stream pool lock held, pool_free_mark done). */
static inline __attribute__((always_inline)) void pool_hold_deferred(cca_pool_t *pool, cca_block_t *block)
{
    pool->held = block;
    pool->held_stats = true;
    atomic_store_explicit(&pool->express, pool->held_in_map && pool_again_ready(pool, block) ? block : NULL,
                          memory_order_relaxed);
}

/* Hold a block returned to its pool back from merging (stream pool lock held, its held
 * blocks flushed), its free's statistics put off if defer (pool_hold_block says when). */
static inline __attribute__((always_inline)) void pool_hold(cca_device_t *dev, cca_block_t *block,
                                                            bool program_free, bool defer)
{
    cca_pool_t *pool = block->pool;
    pool_free_begin(dev, block);
    if (defer) {
        pool_hold_deferred(pool, block);
        return;
    }
    pool->held = block;
    atomic_store_explicit(&pool->express, NULL, memory_order_relaxed);
    pool_hold_stats(block, program_free); /* the merge's with the upper neighbour, put off */
}

/* Hold a block returned to its pool back from merging, pool_may_hold said yes (stream pool
 * lock held, its held blocks flushed): the cached pair's return. An expandable block's
 * statistics are applied now: they leave inactive_split alone, which ops_apply_again does
 * not know. */
static inline __attribute__((always_inline)) void pool_hold_block(cca_device_t *dev, cca_block_t *block,
                                                                  bool program_free)
{
    pool_hold(dev, block, program_free,
              program_free && ops_may_defer(block->pool->owner) && !block->segment->es);
}
/* Raise CCA_ERR_INVALID_POINTER for ptr, saying whether it lies inside a block. */
cca_status_t pool_invalid_pointer(const char *what, const void *ptr);
/* Set a device's state up (cca_state->settings readable) and down. */
cca_status_t pool_device_init(cca_device_t *dev, int index, size_t total_memory);
void pool_device_shutdown(cca_device_t *dev);
/* Give a plain (not expandable) segment's memory back: to its pool's own allocator or the backend. */
cca_status_t pool_segment_give_back(cca_device_t *dev, cca_segment_t *seg);

/* ---- alloc.c: the hot path ------------------------------------------------------ */

size_t alloc_round_size(const cca_settings_t *s, size_t size);
size_t alloc_segment_size(const cca_settings_t *s, size_t size);
/* Hand out *blockp (out of its bin) for size bytes; split: 1 yes, 0 no (pool lock held). */
cca_status_t alloc_take_block(cca_device_t *dev, cca_pool_t *pool, cca_block_t **blockp, size_t size,
                              size_t orig_size, int split);
/* cca_free without the expensive assertion (callers holding the device lock). */
cca_status_t alloc_free(void *ptr);

/* ---- events.c: record_stream events ------------------------------------------- */

/*
 * Enter a stretch that records, queries or synchronises stream events without
 * the device lock; false (nothing entered) while a route is active. Each
 * side's store comes before its load (sequentially consistent): either the
 * caller sees the route, or the route's begin sees the caller and waits for
 * events_leave (events_wait_callers), so no event call of it overlaps a
 * capture begun once the route is in place (PyTorch's mutex orders them).
 */
static inline bool events_enter(cca_device_t *dev)
{
    atomic_fetch_add_explicit(&dev->event_callers, 1, memory_order_seq_cst);
    if (!atomic_load_explicit(&dev->route_count, memory_order_seq_cst))
        return true;
    atomic_fetch_sub_explicit(&dev->event_callers, 1, memory_order_release);
    return false;
}

static inline void events_leave(cca_device_t *dev)
{
    atomic_fetch_sub_explicit(&dev->event_callers, 1, memory_order_release);
}

/* Wait until the stretches entered before the route just published are over (device lock
 * held; they take no device lock). */
void events_wait_callers(cca_device_t *dev);
/* Record an event on every stream that used the block (stream pool lock held). */
cca_status_t events_insert(cca_device_t *dev, cca_block_t *block);
/* Reclaim blocks whose events completed (no stream pool lock held; none while a route is active). */
cca_status_t events_process(cca_device_t *dev);
/* Wait for every pending event (of blocks of private pool only, if set) and reclaim the
 * blocks; held: the pool lock the caller holds. */
cca_status_t events_synchronize_and_free(cca_device_t *dev, cca_stream_pool_t *held,
                                         cca_private_pool_t *only);
/* Set aside the free of a block used on other streams while a route is active (pool lock held). */
void events_defer_free(cca_device_t *dev, cca_block_t *block);
/* record_stream while a route is active: remember the use (pool lock held). */
cca_status_t events_note_capture_use(cca_device_t *dev, cca_block_t *block, cca_stream_t stream);
/* Forget block's capture-time uses; with drop, remove them from its stream uses (pool lock held). */
void events_forget_capture_uses(cca_device_t *dev, cca_block_t *block, bool drop);
/* Complete the set-aside frees (device lock held, no route active; held: a stream pool lock
 * the caller holds, or NULL). */
cca_status_t events_insert_deferred_locked(cca_device_t *dev, cca_stream_pool_t *held);
/* Return the set-aside blocks of stream that its capture has passed (device lock held). */
cca_status_t events_free_safe_in_capture(cca_device_t *dev, cca_stream_t stream);
/* Forget the capture graphs' traversals (device lock held, no route active). */
void events_reuse_reset_locked(cca_device_t *dev);
/* Give the device's idle events back to the backend. */
cca_status_t events_destroy_pooled(cca_device_t *dev);
/* events_process on every device (replay, tests). */
cca_status_t alloc_process_events(void);

/* ---- release.c: release, garbage collection, out of memory ----------------------- */

/* PyTorch's release_cached_blocks (device lock held; held: the pool lock the caller holds). */
cca_status_t release_cached_blocks_locked(cca_device_t *dev, cca_stream_pool_t *held);
/* Release oversize cached blocks covering size (device and pool locks held). */
bool release_available_cached_blocks(cca_device_t *dev, cca_pool_t *pool, size_t size);
/* Age-based garbage collection (device lock held). */
void release_garbage_collect(cca_device_t *dev, cca_stream_pool_t *held);
/* Release every unsplit free block of a pool (device lock held, its pool lock taken unless held). */
cca_status_t release_pool_blocks(cca_device_t *dev, cca_pool_t *pool, cca_stream_pool_t *held);
/* Run the free-memory callbacks (no lock held); true if any freed memory. */
bool release_free_memory_callbacks(void);
/* PyTorch's out-of-memory error, observers notified (no lock held). */
cca_status_t release_raise_oom(cca_device_t *dev, size_t size, size_t alloc_size, cca_stream_t stream);

/* ---- stats.c: statistics entry points ------------------------------------------ */

/* The device's statistics (see stats.c); held: a stream pool lock the caller holds. */
void stats_read_held(cca_device_t *dev, cca_device_stats_t *out, cca_stream_pool_t *held);
void stats_read(cca_device_t *dev, cca_device_stats_t *out);
/* exact_peak_stats: the ops table's current and peak values into out's per-operation arrays. */
void stats_fill_ops(const cca_device_t *dev, cca_device_stats_t *out);

/* ---- peer.c: peer access ------------------------------------------------------- */

/* The devices that may access dev's memory (bit p: device p). Lock-free read. */
static inline uint64_t device_peer_mask(cca_device_t *dev)
{
    return atomic_load_explicit(&dev->peer_mask, memory_order_acquire);
}
/* Give every device of dev's peer mask access to a mapped range (dev->lock held). */
cca_status_t peer_set_access_locked(cca_device_t *dev, void *addr, size_t size);

/* ---- private_pools.c: private pools and routes (above setup, below stats) ------------ */

static inline bool pools_id_eq(cca_mempool_id_t a, cca_mempool_id_t b)
{
    return a.first == b.first && a.second == b.second;
}

static inline bool pools_id_is_default(cca_mempool_id_t id)
{
    return id.first == 0 && id.second == 0;
}

/* Check device and a private pool id for entry point what; *dev on CCA_OK. */
cca_status_t pools_args(const char *what, int device, cca_mempool_id_t id, cca_device_t **dev);
/* CCA_ERR_INVALID_ARGUMENT naming an unknown pool. */
cca_status_t pools_unknown(const char *what, int device, cca_mempool_id_t id);
/* The pool with id, or NULL (device lock held). */
cca_private_pool_t *pools_find_locked(cca_device_t *dev, cca_mempool_id_t id);
/* The stream pool of (pp, stream) if it exists (device lock held). */
cca_stream_pool_t *pools_find_stream_pool(cca_private_pool_t *pp, cca_stream_t stream);
/* Where an allocation on stream goes under the routes: a pinned private stream pool, or NULL. */
cca_status_t pools_route_locked(cca_device_t *dev, cca_stream_t stream, cca_stream_pool_t **out);
void pools_unpin(cca_stream_pool_t *sp);
/* Free bytes cached in private pools (device lock held). */
size_t pools_cached_bytes_locked(cca_device_t *dev);
/* How many private stream pools dev has (device lock held). */
size_t pools_stream_pool_count(cca_device_t *dev);

/* fn on every private pool's stream pool (device lock held); a structure walk, for observe/ too. */
static inline void pools_for_each_stream_pool(cca_device_t *dev,
                                              void (*fn)(cca_stream_pool_t *, void *), void *arg)
{
    for (cca_private_pool_t *pp = dev->private_pools; pp; pp = pp->next)
        for (size_t i = 0; i < pp->stream_pool_count; i++)
            fn(pp->stream_pools[i], arg);
}

/* The id of sp's private pool, (0, 0) for a default stream pool. */
static inline cca_mempool_id_t pools_id_of(const cca_stream_pool_t *sp)
{
    cca_mempool_id_t none = {0, 0};
    return sp->private_pool ? sp->private_pool->id : none;
}

/* ---- expandable.c: expandable segments (above pool.c, below setup.c) --------------
 * All with the device lock and the pool's stream pool lock held, but shutdown. */

/* Grow the pool's expandable segment to hold size bytes (PyTorch's
 * try_allocate_expandable_block); *out leaves its bin. CCA_ERR_OUT_OF_MEMORY: device full. */
cca_status_t expandable_alloc(cca_device_t *dev, cca_pool_t *pool, size_t size, cca_block_t **out);
/* get_free_block's step for an expandable best fit b: the block to use, or NULL. */
cca_block_t *expandable_fit(const cca_pool_t *pool, cca_block_t *b);
/* Unmap the whole granules of a free expandable block; free an empty reservation. */
cca_status_t expandable_unmap(cca_device_t *dev, cca_block_t *block);
/* Checkpoint restore: map what is unmapped of [addr, addr + size) in seg (free, binned). */
cca_status_t expandable_map_range(cca_device_t *dev, cca_segment_t *seg, uintptr_t addr, size_t size);
/* Checkpoint restore: unmap the whole granules of [addr, addr + size) that free blocks of seg
 * hold (the stream waited for first); *released: the reservation went with them. */
cca_status_t expandable_unmap_range(cca_device_t *dev, cca_segment_t *seg, uintptr_t addr, size_t size,
                                    bool *released);
/* Unmap every free expandable block of a pool (release_blocks' expandable half). */
cca_status_t expandable_release_pool(cca_device_t *dev, cca_pool_t *pool);
/* Release handles whose release failed before (device lock held). */
cca_status_t expandable_release_orphans(cca_device_t *dev);
/* Give peer access to every mapped range of dev (device lock held; peer in peer_mask). */
cca_status_t expandable_add_peer(cca_device_t *dev, int peer);
/* Shutdown: give every expandable segment and orphan back to the backend, unlink them. */
void expandable_device_shutdown(cca_device_t *dev);

/* ---- compact.c: compact_memory's moves of free granules (beside expandable.c) ---------
 * With the device lock held; the helpers it shares with expandable.c are in expandable.h. */

/* The planned placement (plan.c): map every granule of [addr, addr + size), free address
 * space of pool's segment from c (the block holding addr) on, free granules moved there
 * first as for a growth; within_limit: only the granules from addr on that moved granules
 * and the room under the limit cover (the pool's lock held too). */
cca_status_t compact_map_range(cca_device_t *dev, cca_pool_t *pool, cca_block_t *c, uintptr_t addr,
                               size_t size, bool within_limit);
/* The planned placement: address space for a plan of size bytes, free and unmapped: the top
 * of one of pool's compact segments, else a new segment's start (the pool's lock held too). */
cca_status_t compact_plan_range(cca_device_t *dev, cca_pool_t *pool, size_t size, cca_segment_t **seg,
                                uintptr_t *base);
/* Unmap the old mappings of aliased blocks whose stream's work is done (wait: after
 * synchronising the stream); held: the stream pool locked by the caller, or NULL. */
cca_status_t compact_settle_aliases(cca_device_t *dev, cca_stream_pool_t *held, bool wait);
/* Destroy the streams' readiness events (empty_cache). */
cca_status_t compact_destroy_ready_events(cca_device_t *dev);
/* The growth limit starts again from the bytes held now (empty_cache). */
void compact_restart_limit(cca_device_t *dev);

/* ---- uncached.c: CCA_NO_CACHING ------------------------------------------------- */

cca_status_t uncached_malloc(cca_device_t *dev, size_t size, cca_stream_t stream, void **ptr);
cca_status_t uncached_free(cca_block_t *block);

#endif /* CCA_DEVICE_H */
