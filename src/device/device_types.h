/*
 * device_types.h - the device caching allocator's structures: blocks, segments,
 * expandable segments, bins, pools and stream pools, the statistics logs,
 * private pools and routes, the device and the process-wide state.
 *
 * Memory comes from the backend in segments; a segment is tiled by blocks
 * (a doubly linked list in address order). A free block sits in exactly one
 * bin of the pool of its own stream and size kind (small: <= 1 MiB requests,
 * large: the rest). Each (device, stream) has its own stream pool with its
 * own lock, so threads on different streams never meet on the fast path;
 * slow paths (new segment, release, OOM, GC, empty cache) take the device
 * lock first, then stream pool locks (lock order: device -> stream pool ->
 * pointer-map shard / stats lock). Files include device.h, which includes this.
 */
#ifndef CCA_DEVICE_TYPES_H
#define CCA_DEVICE_TYPES_H

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
    bool head_split;            /* its first block was split by an allocation since it was made
                                   (or its start last mapped): PyTorch's head block is then a
                                   new one, with no context_when_segment_allocated */
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

#endif /* CCA_DEVICE_TYPES_H */
