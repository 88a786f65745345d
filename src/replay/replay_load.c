/*
 * replay_load.c - read a PyTorch memory snapshot for the replay in one
 * streaming pass: each event dict of device_traces[device] becomes a 32-byte
 * replay_event_t as it is decoded (the dict itself is never built); the other
 * top-level fields (segments, allocator_settings, cca_meta, ...) are kept as a
 * tree, since the replay needs cca_meta, which PyTorch's files write after
 * the events, before it can start.
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
    replay_trace_t t;        /* t.ev: a zero-filled array (cca_zarray_grow) of cap events */
    size_t cap;
    size_t seen;             /* events of the kept device read */
    /* stream handle -> index in t.streams: the last one met, and an open-addressing
     * table of indices + 1 (0: empty) */
    uint64_t last_stream;
    uint32_t last_index;
    uint32_t *stream_slots;
    size_t slots_cap, streams_cap;
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

/* The index of stream handle s in l->t.streams (added when new); false when out of memory. */
static bool stream_index(loader_t *l, uint64_t s, uint32_t *out)
{
    if (l->t.nstreams && s == l->last_stream) {
        *out = l->last_index;
        return true;
    }
    if ((l->t.nstreams + 1) * 2 > l->slots_cap) {
        size_t cap = l->slots_cap ? l->slots_cap * 2 : 64;
        uint32_t *slots = calloc(cap, sizeof(*slots));
        if (!slots)
            return false;
        for (size_t i = 0; i < l->t.nstreams; i++) {
            size_t j = stream_hash(l->t.streams[i]) & (cap - 1);
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
        if (l->t.streams[l->stream_slots[j] - 1] == s)
            break;
    if (!l->stream_slots[j]) {
        if (l->t.nstreams >= UINT32_MAX - 1)
            return false;
        if (l->t.nstreams == l->streams_cap) {
            size_t cap = l->streams_cap ? l->streams_cap * 2 : 8;
            uint64_t *streams = realloc(l->t.streams, cap * sizeof(*streams));
            if (!streams)
                return false;
            l->t.streams = streams;
            l->streams_cap = cap;
        }
        l->t.streams[l->t.nstreams] = s;
        l->stream_slots[j] = (uint32_t)++l->t.nstreams;
    }
    l->last_stream = s;
    l->last_index = l->stream_slots[j] - 1;
    *out = l->last_index;
    return true;
}

static cca_status_t on_record(void *ctx, const pk_record_t *rec)
{
    loader_t *l = ctx;
    if (rec->group != l->device)
        return CCA_OK;
    size_t i = l->seen++;
    replay_trace_t *t = &l->t;
    if (t->count == l->cap) {
        /* grown in place: the events are never copied, and arrive zeroed */
        if (!cca_zarray_grow((void **)&t->ev, &t->ev_bytes, (t->count + 1) * sizeof(*t->ev)))
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for %zu trace events", t->count + 1);
        l->cap = t->ev_bytes / sizeof(*t->ev);
    }
    replay_event_t *e = &t->ev[t->count];
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
    if (!stream_index(l, stream, &e->stream))
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the trace's streams");
    t->count++;
    return CCA_OK;
}

cca_status_t replay_load(const char *path, int device, pv_doc_t **fields, replay_trace_t *trace)
{
    loader_t l;
    memset(&l, 0, sizeof(l));
    l.device = device < 0 ? SIZE_MAX : (size_t)device;
    pk_handler_t h = {
        .ctx = &l, .symbols = tag_names, .symbol_count = TAG_COUNT,
        .field_mode = field_mode, .record = on_record, .group = on_group,
    };
    pv_doc_t *doc = NULL;
    cca_status_t st = pickle_stream_file(path, &h, &doc);
    if (st != CCA_OK)
        goto out_events;
    if (pv_kind(pv_doc_root(doc)) != PV_DICT) {
        st = cca_raise(CCA_ERR_FORMAT, "%s is not a PyTorch memory snapshot (no top-level dict)", path);
        goto out_doc;
    }
    if (!l.saw_traces) {
        st = cca_raise(CCA_ERR_FORMAT, "not a PyTorch memory snapshot: no device_traces list");
        goto out_doc;
    }
    if (device < 0 || (size_t)device >= l.devices) {
        st = cca_raise(CCA_ERR_INVALID_ARGUMENT, "the snapshot has no trace for device %d (%zu devices)",
                       device, l.devices);
        goto out_doc;
    }
    /* a free_requested is deferred unless its free_completed follows at once */
    replay_event_t *ev = l.t.ev;
    size_t n = l.t.count;
    for (size_t i = 0; i < n; i++)
        if (ev[i].kind == EV_FREE_REQUESTED)
            ev[i].deferred = !(i + 1 < n && ev[i + 1].kind == EV_FREE_COMPLETED && ev[i + 1].addr == ev[i].addr);
    if ((!l.t.ev && !cca_zarray_grow((void **)&l.t.ev, &l.t.ev_bytes, sizeof(*l.t.ev))) ||
        (!l.t.streams && !(l.t.streams = calloc(1, sizeof(*l.t.streams))))) {
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the trace events");
        goto out_doc;
    }
    free(l.stream_slots);
    *fields = doc;
    *trace = l.t;
    return CCA_OK;
out_doc:
    pv_doc_free(doc);
out_events:
    free(l.stream_slots);
    replay_trace_free(&l.t);
    return st;
}

void replay_trace_free(replay_trace_t *trace)
{
    cca_zarray_free(trace->ev, trace->ev_bytes);
    free(trace->streams);
    memset(trace, 0, sizeof(*trace));
}
