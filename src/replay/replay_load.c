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
    replay_event_t *ev;      /* a zero-filled array (cca_zarray_grow) of ev_bytes */
    size_t n, cap, ev_bytes;
    size_t seen;             /* events of the kept device read */
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

static cca_status_t on_record(void *ctx, const pk_record_t *rec)
{
    loader_t *l = ctx;
    if (rec->group != l->device)
        return CCA_OK;
    size_t i = l->seen++;
    if (l->n == l->cap) {
        /* grown in place: the events are never copied, and arrive zeroed */
        if (!cca_zarray_grow((void **)&l->ev, &l->ev_bytes, (l->n + 1) * sizeof(*l->ev)))
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for %zu trace events", l->n + 1);
        l->cap = l->ev_bytes / sizeof(*l->ev);
    }
    replay_event_t *e = &l->ev[l->n];
    const pk_value_t *action = rec->by_tag[TAG_ACTION];
    if (!action)
        return cca_raise(CCA_ERR_FORMAT, "trace event %zu has no action", i);
    int32_t t = action->kind == PV_STR ? action->tag : -1;
    e->kind = t >= TAG_ALLOC && t <= TAG_OOM ? (uint8_t)(EV_ALLOC + (t - TAG_ALLOC)) : EV_OTHER;
    bool ok = u64_of(rec->by_tag[TAG_SIZE], &e->size);
    if (e->kind == EV_OOM)
        ok = ok && u64_of(rec->by_tag[TAG_DEVICE_FREE], &e->addr);
    else if (e->kind != EV_OTHER)
        ok = ok && u64_of(rec->by_tag[TAG_ADDR], &e->addr);
    if (!u64_of(rec->by_tag[TAG_STREAM], &e->stream))
        e->stream = 0;
    if (!ok && e->kind != EV_OTHER)
        return cca_raise(CCA_ERR_FORMAT, "trace event %zu (%s) lacks its addr or size", i, action->data);
    l->n++;
    return CCA_OK;
}

cca_status_t replay_load(const char *path, int device, pv_doc_t **fields, replay_event_t **events,
                         size_t *count, size_t *events_bytes)
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
    for (size_t i = 0; i < l.n; i++)
        if (l.ev[i].kind == EV_FREE_REQUESTED)
            l.ev[i].deferred = !(i + 1 < l.n && l.ev[i + 1].kind == EV_FREE_COMPLETED &&
                                 l.ev[i + 1].addr == l.ev[i].addr);
    if (!l.ev && !cca_zarray_grow((void **)&l.ev, &l.ev_bytes, sizeof(*l.ev))) {
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the trace events");
        goto out_doc;
    }
    *fields = doc;
    *events = l.ev;
    *count = l.n;
    *events_bytes = l.ev_bytes;
    return CCA_OK;
out_doc:
    pv_doc_free(doc);
out_events:
    cca_zarray_free(l.ev, l.ev_bytes);
    return st;
}
