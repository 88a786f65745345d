/*
 * replay_events.h - a PyTorch memory snapshot as the replay needs it: the
 * compact event list of one device's trace, and the other top-level fields as
 * a tree. replay_load.c reads it in one streaming pass (pickle_stream.h),
 * never holding the file, the decompressed pickle or a tree of the events.
 *
 * The events live in chunks that never move, so a replay may run on another
 * thread while the file is still being read: the reader publishes the events
 * it has finished through a replay_feed_t, and the replay waits there when it
 * catches up (replay.c).
 */
#ifndef CCA_REPLAY_EVENTS_H
#define CCA_REPLAY_EVENTS_H

#include <pthread.h>

#include "pickle.h"
#include "replay_live.h"

typedef enum replay_kind {
    EV_ALLOC,
    EV_FREE_REQUESTED,
    EV_FREE_COMPLETED,
    EV_SEGMENT_ALLOC,
    EV_SEGMENT_FREE,
    EV_SEGMENT_MAP,
    EV_SEGMENT_UNMAP,
    EV_OOM,
    EV_OTHER,
} replay_kind_t;

typedef struct replay_event {
    uint64_t addr;     /* trace address (oom: device free bytes) */
    uint64_t size;     /* bytes */
    uint32_t stream;   /* index of its stream handle in replay_trace_t.streams */
    uint8_t kind;      /* replay_kind_t */
    bool deferred;     /* free_requested whose free_completed comes later */
    bool invalid;      /* a size negative or of 1 EB or more: not replayed */
} replay_event_t;      /* 24 bytes: a big trace's events are most of the replay's memory */

#define REPLAY_CHUNK_SHIFT 16                         /* events per chunk: 65,536 (1.5 MB) */
#define REPLAY_CHUNK_EVENTS ((size_t)1 << REPLAY_CHUNK_SHIFT)
#define REPLAY_MAX_CHUNKS ((size_t)1 << 16)           /* at most 2^32 events */

/*
 * The trace played forward from an empty allocator, as the reader decodes it
 * (replay_forward.c): the blocks live and the device memory mapped after the
 * last event. `broken` once an event needs memory or a block from before the
 * first one (a free of a block not live, an allocation at a live block's
 * address, an unmapping of memory not mapped, a mapping of mapped memory), or
 * the ranges grow past their bound: only then may the inference of the state
 * before the first event (replay_start.c) find anything, or, with an end
 * state unlike this one, an inconsistency.
 */
typedef struct replay_forward {
    struct replay_keys {
        uint64_t *keys;         /* open addressing, 0 empty; deletions shift back (no tombstones) */
        size_t cap, count;
    } blocks;                   /* live block addresses */
    struct replay_span {
        uint64_t lo, hi;
    } *ranges;                  /* mapped bytes: address order, apart (touching ones merged) */
    size_t nranges, cap;
    uint64_t request;           /* a free_requested's address, checked with the event after it (0: none) */
    bool broken;
} replay_forward_t;

/* A key's home slot: one multiplication (the addresses' high bits spread into the low ones). */
static inline size_t replay_key_home(const struct replay_keys *k, uint64_t key)
{
    return (size_t)((key * 0x9e3779b97f4a7c15ull) >> 32) & (k->cap - 1);
}

static inline size_t replay_key_slot(const struct replay_keys *k, uint64_t key)
{
    size_t j = replay_key_home(k, key);
    while (k->keys[j] && k->keys[j] != key)
        j = (j + 1) & (k->cap - 1);
    return j;
}

/* Whether key (not 0) is in k. */
static inline bool replay_key_has(const struct replay_keys *k, uint64_t key)
{
    return k->cap && k->keys[replay_key_slot(k, key)];
}

/* Out of line: mapped ranges, and a table to grow. */
void replay_forward_rare(replay_forward_t *f, const replay_event_t *e);

/* Play event e (index i of the trace kept) forward: a probe or none, as the reader decodes it. */
static inline void replay_forward_event(replay_forward_t *f, const replay_event_t *e, size_t i)
{
    struct replay_keys *k = &f->blocks;
    if (f->broken || (e->invalid && e->kind != EV_ALLOC))
        return;
    if (f->request) {
        /* a free_requested's block must be live; its free_completed right after checks it too */
        bool both = e->kind == EV_FREE_COMPLETED && e->addr == f->request;
        f->broken = !both && !replay_key_has(k, f->request);
        f->request = 0;
        if (f->broken)
            return;
    }
    if (e->kind == EV_ALLOC) {
        if (!e->addr || (k->count + 1) * 2 > k->cap) {
            replay_forward_rare(f, e);
            return;
        }
        size_t j = replay_key_slot(k, e->addr);
        f->broken = k->keys[j] != 0; /* at a live block */
        k->keys[j] = e->addr;
        k->count++;
    } else if (e->kind == EV_FREE_REQUESTED) {
        f->broken = !e->addr;
        f->request = e->addr;
    } else if (e->kind == EV_FREE_COMPLETED) {
        if (!i)
            return; /* a free made whole before the recording */
        size_t j = e->addr && k->cap ? replay_key_slot(k, e->addr) : 0;
        if (!e->addr || !k->cap || !k->keys[j]) {
            f->broken = true;
            return;
        }
        k->count--;
        for (size_t n = (j + 1) & (k->cap - 1); k->keys[n]; n = (n + 1) & (k->cap - 1)) {
            size_t h = replay_key_home(k, k->keys[n]); /* its home: may it move to j? */
            if ((n > j && (h <= j || h > n)) || (n < j && h <= j && h > n)) {
                k->keys[j] = k->keys[n];
                j = n;
            }
        }
        k->keys[j] = 0;
    } else if (e->kind != EV_OOM && e->kind != EV_OTHER) {
        replay_forward_rare(f, e);
    }
}

/* After the last event: a free_requested there is checked. */
static inline void replay_forward_end(replay_forward_t *f)
{
    if (!f->broken && f->request)
        f->broken = !replay_key_has(&f->blocks, f->request);
    f->request = 0;
}
void replay_forward_free(replay_forward_t *f);
/* Tests: set, the inference undoes every trace (to compare with what it decides without). */
extern bool replay_forward_off;

/* One device's trace. */
typedef struct replay_trace {
    replay_event_t **chunks; /* REPLAY_MAX_CHUNKS slots; chunk k holds events k * 2^16 ... */
    size_t chunk_bytes;      /* bytes of each chunk (core/util.c's zero-filled arrays, all one size) */
    uint64_t *streams;       /* the distinct stream handles, in order of first use */
    size_t nstreams;
    /* count, which the reader advances at every event, lies a cache line away from the
     * fields above, which a replay on another thread reads at every event: sharing a line
     * with them, each event's count cost both threads a transfer of it between their cores */
    char apart[64];
    size_t count;            /* events */
    size_t devices;          /* device_traces entries in the snapshot */
    size_t skipped;          /* events before the first one kept (replay_load's first_event) */
    size_t invalid;          /* events kept flagged invalid */
    size_t quiet_before;     /* events just before the first one kept that an empty_cache or a
                                graph capture's start may make or be among: all but frees and
                                allocations (the generator's 8-byte ones excepted) */
    size_t releases_before;  /* of those, the ones after the last allocation or mapping */
    size_t made_at;          /* 1 + the index of the last allocation or mapping left out (0: none) */
    size_t rng_at[2];        /* 1 + the indices of the last two 8-byte allocations left out (0: none) */
    replay_forward_t forward; /* set once the reading is done (the reader keeps its own until then) */
} replay_trace_t;

/* Event i (< count) of a trace. */
static inline const replay_event_t *replay_ev(const replay_trace_t *t, size_t i)
{
    return &t->chunks[i >> REPLAY_CHUNK_SHIFT][i & (REPLAY_CHUNK_EVENTS - 1)];
}

/*
 * The events of a trace being read, as far as they are final, for a replay on
 * another thread. The reader (replay_load) publishes in batches; the replay
 * reads events below `published` (in the trace's chunks, which never move),
 * and their stream handles through the `streams` pointer published with them
 * (an array the reader never frees, nor changes where those events point,
 * while the feed lives).
 */
typedef struct replay_feed {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    size_t published;            /* events whose every field is final */
    const uint64_t *streams;
    bool done;                   /* the reading ended: published is the trace's count if ok */
    bool ok;                     /* it ended without error */
    bool waiting;                /* the replay waits on cond */
    uint64_t **retired;          /* stream arrays replaced while the feed lives, freed at the end */
    size_t nretired;
} replay_feed_t;

/* What the replay has seen of a feed (one thread). */
typedef struct replay_view {
    size_t published;
    const uint64_t *streams;
    bool done, ok;
} replay_view_t;

/* Set up a feed (lock, condition); false if they cannot be made. */
bool replay_feed_init(replay_feed_t *feed);
/* Free the feed's retired arrays and its lock; no thread may use it any more. */
void replay_feed_destroy(replay_feed_t *feed);
/*
 * Wait until the feed has an event past `have` or has ended, then copy its
 * state into *view. Returns false once the feed ended with `have` events
 * published (all there are), or in error.
 */
bool replay_feed_wait(replay_feed_t *feed, size_t have, replay_view_t *view);

/*
 * Read the snapshot at path into *trace (zeroed by the caller, and freed by
 * it with replay_trace_free whatever the outcome, after the feed's last
 * reader): device_traces[device], and *fields a dict of every other top-level
 * field (root NULL-free: pv_doc_root is a dict; set only on success), the
 * events before first_event left out (as a recording begun there). With
 * feed set, events are published there as they become final, and the feed is
 * ended, ok or not, before the return. Returns CCA_OK, CCA_ERR_IO,
 * CCA_ERR_FORMAT (not a snapshot: no top-level dict or no device_traces
 * list; an event without its action, addr or size; malformed data; more than
 * 2^32 events), CCA_ERR_INVALID_ARGUMENT (no trace for that device),
 * CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t replay_load(const char *path, int device, size_t first_event, replay_feed_t *feed,
                         pv_doc_t **fields, replay_trace_t *trace);
void replay_trace_free(replay_trace_t *trace);

#endif /* CCA_REPLAY_EVENTS_H */
