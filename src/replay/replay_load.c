/*
 * replay_load.c - read a PyTorch memory snapshot for the replay in one
 * streaming pass: each event dict of device_traces[device] becomes a 32-byte
 * replay_event_t as it is decoded (the dict itself is never built); the other
 * top-level fields (segments, allocator_settings, cca_meta, ...) are kept as a
 * tree, since the replay needs cca_meta, which PyTorch's files write after
 * the events, before it can start.
 *
 * With a feed, the events are published in batches as they become final
 * (an event's `deferred` is known once the next one is read), so a replay on
 * another thread can run behind the reading.
 *
 * Invariant: the events are in trace order, one per event dict of the chosen
 * device, and a free_requested is `deferred` unless its free_completed for the
 * same address follows at once.
 */
#include <stdlib.h>
#include <string.h>

#include "pickle_stream.h"
#include "replay_events.h"

/* Keys and action names, recognised by tag rather than by comparing strings. */
enum {
    TAG_ACTION, TAG_ADDR, TAG_SIZE, TAG_STREAM, TAG_DEVICE_FREE,
    TAG_ALLOC, TAG_FREE_REQUESTED, TAG_FREE_COMPLETED, TAG_SEGMENT_ALLOC, TAG_SEGMENT_FREE,
    TAG_SEGMENT_MAP, TAG_SEGMENT_UNMAP, TAG_OOM, TAG_COUNT,
};

static const char *const tag_names[TAG_COUNT] = {
    [TAG_ACTION] = "action", [TAG_ADDR] = "addr", [TAG_SIZE] = "size", [TAG_STREAM] = "stream",
    [TAG_DEVICE_FREE] = "device_free", [TAG_ALLOC] = "alloc", [TAG_FREE_REQUESTED] = "free_requested",
    [TAG_FREE_COMPLETED] = "free_completed", [TAG_SEGMENT_ALLOC] = "segment_alloc",
    [TAG_SEGMENT_FREE] = "segment_free", [TAG_SEGMENT_MAP] = "segment_map",
    [TAG_SEGMENT_UNMAP] = "segment_unmap", [TAG_OOM] = "oom",
};

typedef struct loader {
    size_t device;           /* the trace kept */
    bool saw_traces;         /* device_traces began (as a list) */
    size_t devices;          /* inner lists seen */
    replay_trace_t *t;       /* the caller's; chunks allocated zero-filled as needed */
    size_t seen;             /* events of the kept device read */
    size_t first_event;      /* events before it are left out */
    replay_feed_t *feed;     /* NULL: nobody reads the events before the end */
    size_t next_publish;     /* publish when this many events are final */
    /* stream handle -> index in t.streams: the last one met, and an open-addressing
     * table of indices + 1 (0: empty) */
    uint64_t last_stream;
    uint32_t last_index;
    uint32_t *stream_slots;
    size_t slots_cap, streams_cap;
    replay_forward_t forward; /* the trace played forward, moved into t at the end */
} loader_t;

static pk_mode_t field_mode(void *ctx, const char *key, size_t len)
{
    loader_t *l = ctx;
    if (len == 13 && !memcmp(key, "device_traces", 13)) {
        l->saw_traces = true;
        return PK_RECORDS;
    }
    return PK_TREE;
}

static cca_status_t on_group(void *ctx, const char *field, size_t group)
{
    loader_t *l = ctx;
    (void)field;
    if (group + 1 > l->devices)
        l->devices = group + 1;
    return CCA_OK;
}

/* An int field as uint64 (negative values wrap, as the tree reader's did); false if absent. */
static bool u64_of(const pk_value_t *v, uint64_t *out)
{
    if (!v || v->kind != PV_INT)
        return false;
    *out = v->num.u;
    return true;
}

static size_t stream_hash(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return (size_t)k;
}

/* Free an old streams array, or keep it until the feed ends if a reader may hold it. */
static bool retire_streams(loader_t *l, uint64_t *old)
{
    if (!old || !l->feed) {
        free(old);
        return true;
    }
    uint64_t **list = realloc(l->feed->retired, (l->feed->nretired + 1) * sizeof(*list));
    if (!list)
        return false;
    l->feed->retired = list;
    list[l->feed->nretired++] = old;
    return true;
}

/* Publish the first `final` events (and the streams) to the feed's reader. */
static void publish(loader_t *l, size_t final, bool done, bool ok)
{
    replay_feed_t *f = l->feed;
    pthread_mutex_lock(&f->lock);
    f->published = final;
    f->streams = l->t->streams;
    f->done = done;
    f->ok = ok;
    if (f->waiting)
        pthread_cond_signal(&f->cond);
    pthread_mutex_unlock(&f->lock);
}

/* The index of stream handle s in l->t->streams (added when new); false when out of memory. */
static bool stream_index(loader_t *l, uint64_t s, uint32_t *out)
{
    if (l->t->nstreams && s == l->last_stream) {
        *out = l->last_index;
        return true;
    }
    if ((l->t->nstreams + 1) * 2 > l->slots_cap) {
        size_t cap = l->slots_cap ? l->slots_cap * 2 : 64;
        uint32_t *slots = calloc(cap, sizeof(*slots));
        if (!slots)
            return false;
        for (size_t i = 0; i < l->t->nstreams; i++) {
            size_t j = stream_hash(l->t->streams[i]) & (cap - 1);
            while (slots[j])
                j = (j + 1) & (cap - 1);
            slots[j] = (uint32_t)i + 1;
        }
        free(l->stream_slots);
        l->stream_slots = slots;
        l->slots_cap = cap;
    }
    size_t j = stream_hash(s) & (l->slots_cap - 1);
    for (; l->stream_slots[j]; j = (j + 1) & (l->slots_cap - 1))
        if (l->t->streams[l->stream_slots[j] - 1] == s)
            break;
    if (!l->stream_slots[j]) {
        if (l->t->nstreams >= UINT32_MAX - 1)
            return false;
        if (l->t->nstreams == l->streams_cap) {
            size_t cap = l->streams_cap ? l->streams_cap * 2 : 8;
            uint64_t *streams = malloc(cap * sizeof(*streams));
            if (!streams)
                return false;
            if (l->t->nstreams)
                memcpy(streams, l->t->streams, l->t->nstreams * sizeof(*streams));
            if (!retire_streams(l, l->t->streams)) {
                free(streams);
                return false;
            }
            l->t->streams = streams;
            l->streams_cap = cap;
        }
        l->t->streams[l->t->nstreams] = s;
        l->stream_slots[j] = (uint32_t)++l->t->nstreams;
    }
    l->last_stream = s;
    l->last_index = l->stream_slots[j] - 1;
    *out = l->last_index;
    return true;
}

/* Whether free_requested event e is deferred, given the event after it (NULL: none). */
static bool deferred_before(const replay_event_t *e, const replay_event_t *next)
{
    return !(next && next->kind == EV_FREE_COMPLETED && next->addr == e->addr);
}

#define PUBLISH_BATCH 4096 /* events per publication: few enough lock rounds, a short wait */

static cca_status_t on_record(void *ctx, const pk_record_t *rec)
{
    loader_t *l = ctx;
    if (rec->group != l->device)
        return CCA_OK;
    if (l->seen < l->first_event) {
        const pk_value_t *action = rec->by_tag[TAG_ACTION];
        int32_t tag = action && action->kind == PV_STR ? action->tag : -1;
        l->seen++;
        l->t->skipped++;
        uint64_t size = 0;
        bool rng = tag == TAG_ALLOC && u64_of(rec->by_tag[TAG_SIZE], &size) && size == 8;
        bool made = tag == TAG_SEGMENT_ALLOC || tag == TAG_SEGMENT_MAP || tag == TAG_ALLOC;
        if ((tag != TAG_ALLOC || rng) && tag != TAG_FREE_REQUESTED && tag != TAG_FREE_COMPLETED)
            l->t->quiet_before++;
        else
            l->t->quiet_before = 0;
        if (made || tag == TAG_FREE_REQUESTED || tag == TAG_FREE_COMPLETED)
            l->t->releases_before = 0;
        else
            l->t->releases_before++;
        if (made)
            l->t->made_at = l->seen;
        if (rng) {
            l->t->rng_at[0] = l->t->rng_at[1];
            l->t->rng_at[1] = l->seen;
        }
        return CCA_OK;
    }
    size_t i = l->seen++;
    replay_trace_t *t = l->t;
    size_t k = t->count >> REPLAY_CHUNK_SHIFT;
    if (!(t->count & (REPLAY_CHUNK_EVENTS - 1))) {
        if (k == REPLAY_MAX_CHUNKS)
            return cca_raise(CCA_ERR_FORMAT, "the trace has more than %zu events",
                             REPLAY_MAX_CHUNKS << REPLAY_CHUNK_SHIFT);
        /* a fresh chunk arrives zeroed (fresh pages, untouched until written) */
        void *chunk = NULL;
        size_t bytes = 0; /* a new array: every chunk gets the same size */
        if (!cca_zarray_grow(&chunk, &bytes, REPLAY_CHUNK_EVENTS * sizeof(replay_event_t)))
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for %zu trace events", t->count + 1);
        t->chunks[k] = chunk;
        t->chunk_bytes = bytes;
    }
    replay_event_t *e = &t->chunks[k][t->count & (REPLAY_CHUNK_EVENTS - 1)];
    const pk_value_t *action = rec->by_tag[TAG_ACTION];
    if (!action)
        return cca_raise(CCA_ERR_FORMAT, "trace event %zu has no action", i);
    int32_t tag = action->kind == PV_STR ? action->tag : -1;
    e->kind = tag >= TAG_ALLOC && tag <= TAG_OOM ? (uint8_t)(EV_ALLOC + (tag - TAG_ALLOC)) : EV_OTHER;
    bool ok = u64_of(rec->by_tag[TAG_SIZE], &e->size);
    if (e->kind == EV_OOM)
        ok = ok && u64_of(rec->by_tag[TAG_DEVICE_FREE], &e->addr);
    else if (e->kind != EV_OTHER)
        ok = ok && u64_of(rec->by_tag[TAG_ADDR], &e->addr);
    uint64_t stream;
    if (!u64_of(rec->by_tag[TAG_STREAM], &stream))
        stream = 0;
    if (!ok && e->kind != EV_OTHER)
        return cca_raise(CCA_ERR_FORMAT, "trace event %zu (%s) lacks its addr or size", i, action->data);
    /* a size of 1 EB or more (a negative one wraps there) is no real request: flagged, the
     * replay counts it as an inconsistency and leaves it out */
    e->invalid = e->kind != EV_OTHER && e->kind != EV_OOM && e->size >= ((uint64_t)1 << 60);
    t->invalid += e->invalid;
    replay_forward_event(&l->forward, e, t->count);
    if ((e->kind == EV_SEGMENT_ALLOC || e->kind == EV_SEGMENT_MAP) && !e->addr)
        return cca_raise(CCA_ERR_FORMAT, "trace event %zu (%s) is at address 0", i, action->data);
    if (!stream_index(l, stream, &e->stream))
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the trace's streams");
    if (t->count) {
        /* the event before is final now: a free_requested is deferred unless this
         * event completes it */
        replay_event_t *prev = (replay_event_t *)replay_ev(t, t->count - 1);
        if (prev->kind == EV_FREE_REQUESTED)
            prev->deferred = deferred_before(prev, e);
    }
    t->count++;
    if (l->feed && t->count - 1 >= l->next_publish) {
        publish(l, t->count - 1, false, false);
        l->next_publish = t->count - 1 + PUBLISH_BATCH;
    }
    return CCA_OK;
}

cca_status_t replay_load(const char *path, int device, size_t first_event, replay_feed_t *feed,
                         pv_doc_t **fields, replay_trace_t *trace)
{
    loader_t l;
    memset(&l, 0, sizeof(l));
    l.first_event = first_event;
    l.device = device < 0 ? SIZE_MAX : (size_t)device;
    l.t = trace;
    l.feed = feed;
    l.next_publish = PUBLISH_BATCH;
    pk_handler_t h = {
        .ctx = &l, .symbols = tag_names, .symbol_count = TAG_COUNT,
        .field_mode = field_mode, .record = on_record, .group = on_group, .dict_root = true,
    };
    pv_doc_t *doc = NULL;
    cca_status_t st = CCA_OK;
    if (!trace->chunks && !(trace->chunks = calloc(REPLAY_MAX_CHUNKS, sizeof(*trace->chunks))))
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the trace events");
    if (st == CCA_OK)
        st = pickle_stream_file(path, &h, &doc);
    if (st == CCA_OK && pv_kind(pv_doc_root(doc)) != PV_DICT)
        st = cca_raise(CCA_ERR_FORMAT, "%s is not a PyTorch memory snapshot (no top-level dict)", path);
    if (st == CCA_OK && !l.saw_traces)
        st = cca_raise(CCA_ERR_FORMAT, "not a PyTorch memory snapshot: no device_traces list");
    if (st == CCA_OK && (device < 0 || (size_t)device >= l.devices))
        st = cca_raise(CCA_ERR_INVALID_ARGUMENT, "the snapshot has no trace for device %d (%zu devices)",
                       device, l.devices);
    if (st == CCA_OK && trace->count) {
        replay_event_t *last = (replay_event_t *)replay_ev(trace, trace->count - 1);
        if (last->kind == EV_FREE_REQUESTED)
            last->deferred = deferred_before(last, NULL);
    }
    if (st == CCA_OK && !trace->streams && !(trace->streams = calloc(1, sizeof(*trace->streams))))
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the trace events");
    free(l.stream_slots);
    replay_forward_end(&l.forward);
    trace->forward = l.forward;
    trace->devices = l.devices;
    if (feed)
        publish(&l, st == CCA_OK ? trace->count : feed->published, true, st == CCA_OK);
    if (st != CCA_OK) {
        pv_doc_free(doc);
        return st;
    }
    *fields = doc;
    return CCA_OK;
}

void replay_trace_free(replay_trace_t *trace)
{
    if (trace->chunks) {
        for (size_t k = 0; k < REPLAY_MAX_CHUNKS && trace->chunks[k]; k++)
            cca_zarray_free(trace->chunks[k], trace->chunk_bytes);
        free(trace->chunks);
    }
    free(trace->streams);
    replay_forward_free(&trace->forward);
    memset(trace, 0, sizeof(*trace));
}

bool replay_feed_init(replay_feed_t *feed)
{
    memset(feed, 0, sizeof(*feed));
    if (pthread_mutex_init(&feed->lock, NULL))
        return false;
    if (pthread_cond_init(&feed->cond, NULL)) {
        pthread_mutex_destroy(&feed->lock);
        return false;
    }
    return true;
}

void replay_feed_destroy(replay_feed_t *feed)
{
    for (size_t i = 0; i < feed->nretired; i++)
        free(feed->retired[i]);
    free(feed->retired);
    pthread_cond_destroy(&feed->cond);
    pthread_mutex_destroy(&feed->lock);
    memset(feed, 0, sizeof(*feed));
}

bool replay_feed_wait(replay_feed_t *feed, size_t have, replay_view_t *view)
{
    pthread_mutex_lock(&feed->lock);
    while (feed->published <= have && !feed->done) {
        feed->waiting = true;
        pthread_cond_wait(&feed->cond, &feed->lock);
    }
    feed->waiting = false;
    view->published = feed->published;
    view->streams = feed->streams;
    view->done = feed->done;
    view->ok = feed->ok;
    pthread_mutex_unlock(&feed->lock);
    return view->ok || !view->done ? view->published > have : false;
}
