/*
 * replay_explain.c - what a replay held at the peak of its reserved memory
 * (cca_replay_explain): the replay runs with an observer (replay_observe.h)
 * that maps cca's pointers to the trace events that allocated them and, each
 * time reserved memory passes its highest so far (or, there, allocated memory
 * does), takes a snapshot of the segments; the last one is the peak: of the
 * moments at the highest reservation, the first with the most bytes
 * allocated. The live blocks are then named from the trace, read again: their
 * stream and time (the innermost annotation open then) in a streaming pass,
 * their first frame outside torch from a tree of the file, read only when
 * they carry frames.
 *
 * Invariant: a capture describes cca's state after one trace event, whole.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pickle_stream.h"
#include "replay_observe.h"

/* cca pointer -> the trace event that placed it last (open addressing, never deleted). */
typedef struct ptr_slot {
    uint64_t ptr;   /* 0: empty */
    uint64_t index;
} ptr_slot_t;

/* A live block at the capture. */
typedef struct live_block {
    uint64_t index;     /* its allocation's trace event; UINT64_MAX: unknown */
    uint64_t size;      /* bytes of the block */
    uint64_t requested; /* bytes asked for */
} live_block_t;

typedef struct explain_ctx {
    ptr_slot_t *slots;
    size_t cap, used;
    int64_t best;            /* the highest reserved bytes seen */
    int64_t best_allocated;  /* the most allocated bytes seen while reserved was at best */
    bool oom;                /* out of host memory while watching */
    /* the capture at `best` */
    uint64_t event;
    live_block_t *live;
    size_t nlive;
    cca_explain_entry_t seg[CCA_EXPLAIN_TOP];
    size_t nseg;
    uint64_t segments, segments_with_free, free_bytes, largest_free;
} explain_ctx_t;

static size_t ptr_hash(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return (size_t)k;
}

static bool ptr_grow(explain_ctx_t *c)
{
    size_t cap = c->cap ? 2 * c->cap : 4096;
    ptr_slot_t *slots = calloc(cap, sizeof(*slots));
    if (!slots)
        return false;
    for (size_t i = 0; i < c->cap; i++) {
        if (!c->slots[i].ptr)
            continue;
        size_t j = ptr_hash(c->slots[i].ptr) & (cap - 1);
        while (slots[j].ptr)
            j = (j + 1) & (cap - 1);
        slots[j] = c->slots[i];
    }
    free(c->slots);
    c->slots = slots;
    c->cap = cap;
    return true;
}

static void on_alloc(void *ctx, size_t index, uint64_t ptr)
{
    explain_ctx_t *c = ctx;
    if ((c->used + 1) * 2 > c->cap && !ptr_grow(c)) {
        c->oom = true;
        return;
    }
    size_t j = ptr_hash(ptr) & (c->cap - 1);
    while (c->slots[j].ptr && c->slots[j].ptr != ptr)
        j = (j + 1) & (c->cap - 1);
    c->used += !c->slots[j].ptr;
    c->slots[j] = (ptr_slot_t){ptr, index};
}

static uint64_t ptr_event(const explain_ctx_t *c, uint64_t ptr)
{
    if (!c->cap)
        return UINT64_MAX;
    for (size_t j = ptr_hash(ptr) & (c->cap - 1); c->slots[j].ptr; j = (j + 1) & (c->cap - 1))
        if (c->slots[j].ptr == ptr)
            return c->slots[j].index;
    return UINT64_MAX;
}

/* Insert a segment into the ranking by free bytes (largest first). */
static void rank_segment(explain_ctx_t *c, const cca_segment_info_t *s, uint64_t free_bytes,
                         uint64_t pieces, uint64_t largest)
{
    size_t at = c->nseg;
    while (at > 0 && c->seg[at - 1].bytes < free_bytes)
        at--;
    if (at >= CCA_EXPLAIN_TOP)
        return;
    size_t move = (c->nseg < CCA_EXPLAIN_TOP ? c->nseg : CCA_EXPLAIN_TOP - 1) - at;
    memmove(&c->seg[at + 1], &c->seg[at], move * sizeof(c->seg[0]));
    cca_explain_entry_t *e = &c->seg[at];
    snprintf(e->name, sizeof(e->name),
             "0x%" PRIx64 " (%.1f MiB, %s%s pool, stream 0x%" PRIxPTR "): largest free piece %.1f MiB",
             s->address, (double)s->total_size / 1048576.0, s->is_expandable ? "expandable, " : "",
             s->is_large ? "large" : "small", (uintptr_t)s->stream, (double)largest / 1048576.0);
    e->bytes = free_bytes;
    e->count = pieces;
    if (c->nseg < CCA_EXPLAIN_TOP)
        c->nseg++;
}

/* Take the state after event index (reserved memory at a new high). */
static bool capture(explain_ctx_t *c, size_t index)
{
    cca_snapshot_t *snap = NULL;
    if (cca_snapshot(&snap) != CCA_OK)
        return false;
    size_t blocks = 0;
    for (size_t s = 0; s < snap->segment_count; s++)
        blocks += snap->segments[s].block_count;
    live_block_t *live = malloc((blocks ? blocks : 1) * sizeof(*live));
    if (!live) {
        cca_snapshot_free(snap);
        cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory explaining the peak");
        return false;
    }
    free(c->live);
    c->live = live;
    c->nlive = 0;
    c->nseg = 0;
    c->event = index;
    c->segments = c->segments_with_free = c->free_bytes = c->largest_free = 0;
    for (size_t s = 0; s < snap->segment_count; s++) {
        const cca_segment_info_t *seg = &snap->segments[s];
        if (seg->device != 0)
            continue;
        uint64_t free_bytes = 0, pieces = 0, largest = 0;
        for (size_t b = 0; b < seg->block_count; b++) {
            const cca_block_info_t *blk = &seg->blocks[b];
            if (blk->state == CCA_BLOCK_INACTIVE) {
                free_bytes += blk->size;
                pieces++;
                largest = blk->size > largest ? blk->size : largest;
            } else {
                c->live[c->nlive++] = (live_block_t){ptr_event(c, blk->address), blk->size,
                                                     blk->requested_size};
            }
        }
        c->segments++;
        c->free_bytes += free_bytes;
        c->largest_free = largest > c->largest_free ? largest : c->largest_free;
        if (pieces) {
            c->segments_with_free++;
            rank_segment(c, seg, free_bytes, pieces, largest);
        }
    }
    cca_snapshot_free(snap);
    return true;
}

static bool after_event(void *ctx, size_t index)
{
    explain_ctx_t *c = ctx;
    if (c->oom) {
        cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory explaining the peak");
        return false;
    }
    cca_device_stats_t stats;
    if (cca_get_device_stats(0, &stats) != CCA_OK)
        return false;
    int64_t reserved = stats.reserved_bytes[CCA_STAT_ALL].current;
    int64_t allocated = stats.allocated_bytes[CCA_STAT_ALL].current;
    if (reserved < c->best || (reserved == c->best && allocated <= c->best_allocated))
        return true;
    c->best = reserved;
    c->best_allocated = allocated;
    return capture(c, index);
}

/* ---- naming the live blocks from the trace ------------------------------------------ */

/* A group being summed: its name and totals. */
typedef struct group {
    char name[160];
    uint64_t bytes, count;
} group_t;

typedef struct groups {
    group_t *items;
    size_t count, cap;
} groups_t;

static bool groups_add(groups_t *g, const char *name, uint64_t bytes)
{
    for (size_t i = 0; i < g->count; i++)
        if (!strcmp(g->items[i].name, name)) {
            g->items[i].bytes += bytes;
            g->items[i].count++;
            return true;
        }
    if (g->count == g->cap) {
        size_t cap = g->cap ? 2 * g->cap : 64;
        group_t *items = realloc(g->items, cap * sizeof(*items));
        if (!items)
            return false;
        g->items = items;
        g->cap = cap;
    }
    group_t *e = &g->items[g->count++];
    snprintf(e->name, sizeof(e->name), "%s", name);
    e->bytes = bytes;
    e->count = 1;
    return true;
}

static int group_cmp(const void *a, const void *b)
{
    const group_t *x = a, *y = b;
    if (x->bytes != y->bytes)
        return x->bytes < y->bytes ? 1 : -1;
    return strcmp(x->name, y->name);
}

/* The top CCA_EXPLAIN_TOP of g into out; returns how many. */
static size_t groups_top(groups_t *g, cca_explain_entry_t *out, uint64_t *distinct)
{
    if (g->count)
        qsort(g->items, g->count, sizeof(*g->items), group_cmp);
    size_t n = g->count < CCA_EXPLAIN_TOP ? g->count : CCA_EXPLAIN_TOP;
    for (size_t i = 0; i < n; i++) {
        memcpy(out[i].name, g->items[i].name, sizeof(out[i].name));
        out[i].bytes = g->items[i].bytes;
        out[i].count = g->items[i].count;
    }
    *distinct = g->count;
    return n;
}

static bool str_of(const pv_node_t *n, const char *key, const char **s, size_t *len)
{
    const pv_node_t *v = n && pv_kind(n) == PV_DICT ? pv_dict_get(n, key) : NULL;
    return v && pv_get_str(v, s, len);
}

static bool has_suffix(const char *s, size_t len, const char *suffix)
{
    size_t n = strlen(suffix);
    return len >= n && !memcmp(s + len - n, suffix, n);
}

static bool contains(const char *s, size_t len, const char *part)
{
    size_t n = strlen(part);
    for (size_t i = 0; i + n <= len; i++)
        if (!memcmp(s + i, part, n))
            return true;
    return false;
}

/*
 * The call site of an event: its first Python frame outside torch (else its
 * first Python frame, else its first frame), as "file:line function".
 */
static void call_site(const pv_node_t *event, char *buf, size_t size)
{
    const pv_node_t *frames = event ? pv_dict_get(event, "frames") : NULL;
    size_t n = frames && (pv_kind(frames) == PV_LIST || pv_kind(frames) == PV_TUPLE) ? pv_len(frames) : 0;
    const pv_node_t *pick = NULL, *first_py = NULL;
    for (size_t i = 0; i < n && !pick; i++) {
        const pv_node_t *f = pv_at(frames, i);
        const char *file;
        size_t len;
        if (!str_of(f, "filename", &file, &len) || !has_suffix(file, len, ".py"))
            continue;
        if (!first_py)
            first_py = f;
        if (!contains(file, len, "/torch/"))
            pick = f;
    }
    if (!pick)
        pick = first_py ? first_py : (n ? pv_at(frames, 0) : NULL);
    const char *file = "?", *name = "?";
    size_t flen = 1, nlen = 1;
    int64_t line = 0;
    if (!pick || !str_of(pick, "filename", &file, &flen)) {
        snprintf(buf, size, "(no stack recorded)");
        return;
    }
    str_of(pick, "name", &name, &nlen);
    const pv_node_t *ln = pv_dict_get(pick, "line");
    if (ln)
        pv_get_int(ln, &line);
    /* keep the end of a long path: the file name is what tells */
    if (flen > 80) {
        file += flen - 80;
        flen = 80;
    }
    snprintf(buf, size, "%.*s:%lld %.*s", (int)flen, file, (long long)line, (int)(nlen > 60 ? 60 : nlen), name);
}

/* The innermost annotation of device open at time t (START <= t < END), or NULL. */
static const pv_node_t *annotation_at(const pv_node_t *list, int device, int64_t t)
{
    const pv_node_t *stack[64];
    size_t depth = 0, n = list && pv_kind(list) == PV_LIST ? pv_len(list) : 0;
    for (size_t i = 0; i < n; i++) {
        const pv_node_t *a = pv_at(list, i);
        if (pv_kind(a) != PV_DICT)
            continue;
        const pv_node_t *tn = pv_dict_get(a, "time_us"), *dn = pv_dict_get(a, "device");
        const pv_node_t *stage = pv_dict_get(a, "stage"), *name = pv_dict_get(a, "name");
        int64_t at, dev = device;
        if (!tn || !pv_get_int(tn, &at) || !stage || !name || (dn && pv_get_int(dn, &dev) && dev != device))
            continue;
        if (at > t)
            break;
        if (pv_str_eq(stage, "START")) {
            if (depth < sizeof(stack) / sizeof(stack[0]))
                stack[depth++] = name;
        } else if (pv_str_eq(stage, "END")) {
            const char *s;
            size_t len;
            if (!pv_get_str(name, &s, &len))
                continue;
            for (size_t k = depth; k-- > 0;) { /* the last START of that name ends */
                const char *o;
                size_t olen;
                if (pv_get_str(stack[k], &o, &olen) && olen == len && !memcmp(o, s, len)) {
                    memmove(&stack[k], &stack[k + 1], (depth - k - 1) * sizeof(stack[0]));
                    depth--;
                    break;
                }
            }
        }
    }
    return depth ? stack[depth - 1] : NULL;
}

/* What the trace says of one live block's allocation event. */
typedef struct event_info {
    uint64_t index;      /* the event (sorted, distinct) */
    int64_t time_us;
    uint64_t stream;
    bool seen, has_time, has_frames;
    char site[160];      /* its call site */
} event_info_t;

enum { TAG_TIME_US, TAG_STREAM, TAG_FRAMES, TAG_COUNT };
static const char *const info_tags[TAG_COUNT] = {"time_us", "stream", "frames"};

typedef struct info_reader {
    event_info_t *info;
    size_t count;
    size_t device;
    bool frames;         /* some wanted event has frames: the tree is read for them */
} info_reader_t;

static event_info_t *info_find(event_info_t *info, size_t count, uint64_t index)
{
    size_t lo = 0, hi = count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (info[mid].index < index)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < count && info[lo].index == index ? &info[lo] : NULL;
}

static pk_mode_t info_field_mode(void *ctx, const char *key, size_t len)
{
    (void)ctx;
    if (len == 13 && !memcmp(key, "device_traces", 13))
        return PK_RECORDS;
    if (len == 20 && !memcmp(key, "external_annotations", 20))
        return PK_TREE;
    return PK_SKIP;
}

static cca_status_t info_record(void *ctx, const pk_record_t *rec)
{
    info_reader_t *r = ctx;
    if (rec->group != r->device || strcmp(rec->field, "device_traces"))
        return CCA_OK;
    event_info_t *e = info_find(r->info, r->count, rec->index);
    if (!e)
        return CCA_OK;
    const pk_value_t *t = rec->by_tag[TAG_TIME_US], *s = rec->by_tag[TAG_STREAM], *f = rec->by_tag[TAG_FRAMES];
    e->seen = true;
    e->has_time = t && t->kind == PV_INT && !t->is_u64;
    e->time_us = e->has_time ? t->num.i : 0;
    e->stream = s && s->kind == PV_INT ? s->num.u : 0;
    e->has_frames = f && (f->kind == PV_LIST || f->kind == PV_TUPLE || (f->node && pv_len(f->node)));
    r->frames |= e->has_frames;
    return CCA_OK;
}

static int u64_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/*
 * The events of c's live blocks as the trace at path (device) gives them: time,
 * stream, call site. One streaming pass; a second, as a tree, only when some of
 * them carry frames. *out (sorted by index) is the caller's to free.
 */
static cca_status_t read_info(const char *path, int device, const explain_ctx_t *c, event_info_t **out,
                              size_t *count, pv_doc_t **fields)
{
    *out = NULL;
    *count = 0;
    uint64_t *idx = malloc((c->nlive ? c->nlive : 1) * sizeof(*idx));
    event_info_t *info = calloc(c->nlive ? c->nlive : 1, sizeof(*info));
    if (!idx || !info) {
        free(idx);
        free(info);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory explaining the peak");
    }
    size_t n = 0;
    for (size_t i = 0; i < c->nlive; i++)
        if (c->live[i].index != UINT64_MAX)
            idx[n++] = c->live[i].index;
    if (n)
        qsort(idx, n, sizeof(*idx), u64_cmp);
    size_t distinct = 0;
    for (size_t i = 0; i < n; i++)
        if (!distinct || idx[i] != info[distinct - 1].index)
            info[distinct++].index = idx[i];
    free(idx);
    info_reader_t r = {info, distinct, (size_t)device, false};
    pk_handler_t h = {.ctx = &r, .symbols = info_tags, .symbol_count = TAG_COUNT,
                      .field_mode = info_field_mode, .record = info_record};
    cca_status_t st = pickle_stream_file(path, &h, fields);
    pv_doc_t *doc = NULL;
    if (st == CCA_OK && r.frames)
        st = pickle_load_file(path, &doc);
    const pv_node_t *traces = doc ? pv_dict_get(pv_doc_root(doc), "device_traces") : NULL;
    const pv_node_t *trace = traces && pv_kind(traces) == PV_LIST && (size_t)device < pv_len(traces)
                                 ? pv_at(traces, (size_t)device) : NULL;
    size_t nev = trace && pv_kind(trace) == PV_LIST ? pv_len(trace) : 0;
    for (size_t i = 0; st == CCA_OK && i < distinct; i++) {
        const pv_node_t *ev = info[i].has_frames && info[i].index < nev ? pv_at(trace, info[i].index) : NULL;
        if (ev && pv_kind(ev) == PV_DICT)
            call_site(ev, info[i].site, sizeof(info[i].site));
        else
            snprintf(info[i].site, sizeof(info[i].site), "(no stack recorded)");
    }
    pv_doc_free(doc);
    if (st != CCA_OK) {
        free(info);
        return st;
    }
    *out = info;
    *count = distinct;
    return CCA_OK;
}

/* Name and sum the live blocks of c from the trace at path (device). */
static cca_status_t name_live(const char *path, int device, const explain_ctx_t *c, cca_replay_explain_t *x)
{
    event_info_t *info = NULL;
    size_t ninfo = 0;
    pv_doc_t *fields = NULL;
    cca_status_t st = read_info(path, device, c, &info, &ninfo, &fields);
    if (st != CCA_OK)
        return st;
    const pv_node_t *annotations = pv_dict_get(pv_doc_root(fields), "external_annotations");
    groups_t frames = {0}, notes = {0}, streams = {0};
    char name[160];
    bool ok = true;
    for (size_t i = 0; i < c->nlive && ok; i++) {
        const live_block_t *b = &c->live[i];
        const event_info_t *ev = b->index != UINT64_MAX ? info_find(info, ninfo, b->index) : NULL;
        if (ev && !ev->seen)
            ev = NULL;
        ok = groups_add(&frames, ev ? ev->site : "(allocated before the trace)", b->size);
        const pv_node_t *note = ev && ev->has_time ? annotation_at(annotations, device, ev->time_us) : NULL;
        const char *s;
        size_t len;
        if (!ev)
            snprintf(name, sizeof(name), "(allocated before the trace)");
        else if (note && pv_get_str(note, &s, &len))
            snprintf(name, sizeof(name), "%.*s", (int)(len > 150 ? 150 : len), s);
        else
            snprintf(name, sizeof(name), "(no annotation open)");
        ok = ok && groups_add(&notes, name, b->size);
        if (!ev)
            snprintf(name, sizeof(name), "(allocated before the trace)");
        else if (ev->stream)
            snprintf(name, sizeof(name), "stream 0x%" PRIx64, ev->stream);
        else
            snprintf(name, sizeof(name), "default stream");
        ok = ok && groups_add(&streams, name, b->size);
    }
    if (ok) {
        x->frame_count = groups_top(&frames, x->frames, &x->frames_distinct);
        x->annotation_count = groups_top(&notes, x->annotations, &x->annotations_distinct);
        x->stream_count = groups_top(&streams, x->streams, &x->streams_distinct);
    } else {
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory explaining the peak");
    }
    free(frames.items);
    free(notes.items);
    free(streams.items);
    free(info);
    pv_doc_free(fields);
    return st;
}

cca_status_t cca_replay_explain(const char *path, const cca_replay_options_t *options,
                                cca_replay_result_t *result, cca_replay_explain_t *explain)
{
    if (!path || !result || !explain)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_replay_explain: path, result and explain are required");
    memset(explain, 0, sizeof(*explain));
    cca_replay_options_t opt;
    memset(&opt, 0, sizeof(opt));
    if (options)
        opt = *options;
    explain_ctx_t c;
    memset(&c, 0, sizeof(c));
    c.best = -1;
    c.best_allocated = -1;
    replay_observer_t obs = {&c, on_alloc, after_event};
    cca_status_t st = replay_file_observed(path, &opt, &obs, result);
    if (st == CCA_OK && c.best >= 0) {
        explain->peak_event = c.event;
        explain->reserved_bytes = (uint64_t)c.best;
        explain->live_allocations = c.nlive;
        for (size_t i = 0; i < c.nlive; i++) {
            explain->live_bytes += c.live[i].size;
            explain->live_requested_bytes += c.live[i].requested;
        }
        explain->cached_free_bytes = c.free_bytes;
        explain->largest_free_bytes = c.largest_free;
        explain->segments = c.segments;
        explain->segments_with_free = c.segments_with_free;
        explain->segment_count = c.nseg;
        memcpy(explain->free_segments, c.seg, sizeof(c.seg));
        st = name_live(path, opt.device, &c, explain);
        if (st != CCA_OK)
            cca_replay_result_free(result);
    }
    free(c.slots);
    free(c.live);
    return st;
}
