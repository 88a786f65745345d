/*
 * snapshot_write.c - the allocator's state and history as PyTorch 2.11's
 * snapshot (torch.cuda.memory._snapshot()), built from the plain data the
 * device allocator hands over (snapshot_parts_t, device/snapshot.c) and
 * written as a pickle (for torch.cuda._memory_viz and cca replay), JSON or
 * SVG; and the conversion of snapshot files to JSON and SVG.
 *
 * The tree has PyTorch's keys, in PyTorch's order, with PyTorch's value
 * types (ints, str, bool, float, the (0, 0) pool id tuple). A user context
 * becomes `frames`: one frame {"filename": line, "line": 0, "name": ""} per
 * line of the context string, on the trace entries and blocks that carry one.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pickle.h"
#include "snapshot_io.h"

static const char *const state_names[] = {"inactive", "active_allocated", "active_pending_free"};

const char *cca_block_state_name(cca_block_state_t state)
{
    return (unsigned)state < 3 ? state_names[state] : "unknown";
}

/* A non-negative integer as a Python int. */
static pv_node_t *pv_uint(pv_doc_t *doc, uint64_t v)
{
    return v <= (uint64_t)INT64_MAX ? pv_new_int(doc, (int64_t)v) : pv_new_u64(doc, v);
}

/* The frames list of a context string (empty list for NULL). */
static pv_node_t *frames_of(pv_doc_t *doc, const char *context)
{
    pv_node_t *list = pv_new_list(doc);
    if (!list || !context)
        return list;
    const char *p = context;
    while (*p) {
        const char *end = strchr(p, '\n');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len) {
            pv_node_t *frame = pv_new_dict(doc);
            if (!frame)
                return NULL;
            pv_dict_set(doc, frame, "filename", pv_new_text(doc, p, len));
            pv_dict_set(doc, frame, "line", pv_new_int(doc, 0));
            pv_dict_set(doc, frame, "name", pv_new_str(doc, ""));
            if (pv_list_append(doc, list, frame) != CCA_OK)
                return NULL;
        }
        p += len;
        if (*p == '\n')
            p++;
    }
    return list;
}

static cca_status_t add_segments(pv_doc_t *doc, pv_node_t *list, const cca_snapshot_t *snap)
{
    for (size_t i = 0; i < snap->segment_count; i++) {
        const cca_segment_info_t *s = &snap->segments[i];
        pv_node_t *d = pv_new_dict(doc);
        if (!d)
            return CCA_ERR_OUT_OF_MEMORY;
        pv_node_t *zero[2] = {pv_new_int(doc, (int64_t)s->owner_private_pool_id[0]),
                              pv_new_int(doc, (int64_t)s->owner_private_pool_id[1])};
        pv_dict_set(doc, d, "device", pv_new_int(doc, s->device));
        pv_dict_set(doc, d, "address", pv_uint(doc, s->address));
        pv_dict_set(doc, d, "total_size", pv_uint(doc, s->total_size));
        pv_dict_set(doc, d, "allocated_size", pv_uint(doc, s->allocated_size));
        pv_dict_set(doc, d, "active_size", pv_uint(doc, s->active_size));
        pv_dict_set(doc, d, "requested_size", pv_uint(doc, s->requested_size));
        pv_dict_set(doc, d, "stream", pv_uint(doc, (uint64_t)(uintptr_t)s->stream));
        pv_dict_set(doc, d, "segment_type", pv_new_str(doc, s->is_large ? "large" : "small"));
        pv_dict_set(doc, d, "segment_pool_id", pv_new_tuple(doc, 2, zero));
        pv_dict_set(doc, d, "is_expandable", pv_new_bool(doc, s->is_expandable));
        pv_dict_set(doc, d, "frames", frames_of(doc, s->context)); /* the segment's creation */
        pv_node_t *blocks = pv_new_list(doc);
        for (size_t j = 0; blocks && j < s->block_count; j++) {
            const cca_block_info_t *b = &s->blocks[j];
            pv_node_t *bd = pv_new_dict(doc);
            if (!bd)
                return CCA_ERR_OUT_OF_MEMORY;
            pv_dict_set(doc, bd, "address", pv_uint(doc, b->address));
            pv_dict_set(doc, bd, "size", pv_uint(doc, b->size));
            pv_dict_set(doc, bd, "requested_size", pv_uint(doc, b->requested_size));
            pv_dict_set(doc, bd, "state", pv_new_str(doc, cca_block_state_name(b->state)));
            pv_dict_set(doc, bd, "frames", frames_of(doc, b->context));
            pv_list_append(doc, blocks, bd);
        }
        pv_dict_set(doc, d, "blocks", blocks);
        cca_status_t st = pv_list_append(doc, list, d);
        if (st != CCA_OK)
            return st;
    }
    return CCA_OK;
}

static cca_status_t add_traces(pv_doc_t *doc, pv_node_t *traces, pv_node_t *annotations,
                               const cca_trace_entry_t *entries, size_t count, int devices)
{
    pv_node_t **lists = calloc((size_t)devices, sizeof(*lists));
    if (!lists)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory writing the history");
    cca_status_t st = CCA_OK;
    for (int d = 0; d < devices; d++) {
        lists[d] = pv_new_list(doc);
        st = pv_list_append(doc, traces, lists[d]);
        if (st != CCA_OK)
            goto out;
    }
    for (size_t i = 0; i < count; i++) {
        const cca_trace_entry_t *e = &entries[i];
        if (e->device < 0 || e->device >= devices)
            continue;
        if (e->action == CCA_TRACE_USER_DEFINED) {
            /* PyTorch 2.11 keeps annotations out of device_traces: its fields, then where and when */
            pv_node_t *a = pv_new_dict(doc);
            const char *k, *v;
            for (size_t f = 0; cca_trace_entry_field_at(e, f, &k, &v); f++)
                pv_dict_set_node(doc, a, pv_new_text(doc, k, strlen(k)), pv_new_text(doc, v, strlen(v)));
            pv_dict_set(doc, a, "device", pv_new_int(doc, e->device));
            pv_dict_set(doc, a, "time_us", pv_new_int(doc, e->time_us));
            st = pv_list_append(doc, annotations, a);
            if (st != CCA_OK)
                goto out;
            continue;
        }
        pv_node_t *d = pv_new_dict(doc);
        pv_dict_set(doc, d, "action", pv_new_str(doc, cca_trace_action_name(e->action)));
        pv_dict_set(doc, d, e->action == CCA_TRACE_OOM ? "device_free" : "addr", pv_uint(doc, e->addr));
        pv_dict_set(doc, d, "size", pv_uint(doc, e->size));
        pv_dict_set(doc, d, "stream", pv_uint(doc, (uint64_t)(uintptr_t)e->stream));
        pv_dict_set(doc, d, "time_us", pv_new_int(doc, e->time_us));
        if (e->context)
            pv_dict_set(doc, d, "frames", frames_of(doc, e->context));
        const char *cc = e->compile_context ? e->compile_context : "N/A";
        const char *md = e->user_metadata ? e->user_metadata : "";
        pv_dict_set(doc, d, "compile_context", pv_new_text(doc, cc, strlen(cc)));
        pv_dict_set(doc, d, "user_metadata", pv_new_text(doc, md, strlen(md)));
        st = pv_list_append(doc, lists[e->device], d);
        if (st != CCA_OK)
            goto out;
    }
out:
    free(lists);
    return st;
}

/*
 * The settings string in effect: every key not at its default, as
 * "key:value" (what replaying the file needs to decide the same way).
 * False: out of host memory (out is then not the whole string).
 */
static bool conf_string(const cca_settings_t *s, cca_strbuf_t *out)
{
    cca_strbuf_t desc;
    sb_init(&desc);
    settings_describe(s, &desc);
    const char *line = desc.data;
    bool first = true;
    while (line && *line) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        const char *space = memchr(line, ' ', len);
        const char *paren = NULL;
        for (const char *p = line + len; p > line; p--)
            if (p[-1] == '(') {
                paren = p - 1;
                break;
            }
        bool is_default = paren && !strncmp(paren, "(default)", 9);
        if (space && paren && paren > space + 1 && !is_default && strncmp(line, "backend ", 8)) {
            sb_printf(out, "%s%.*s:%.*s", first ? "" : ",", (int)(space - line), line,
                      (int)(paren - 1 - (space + 1)), space + 1);
            first = false;
        }
        line = end ? end + 1 : NULL;
    }
    bool ok = !desc.failed;
    sb_free(&desc);
    if (!out->data)
        sb_append(out, "");
    return ok && !out->failed;
}

static cca_status_t add_settings(pv_doc_t *doc, pv_node_t *root, const snapshot_parts_t *parts)
{
    const cca_settings_t *s = parts->settings;
    cca_strbuf_t conf;
    sb_init(&conf);
    if (!conf_string(s, &conf)) { /* a file replayed under other settings: none at all */
        sb_free(&conf);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory writing a snapshot");
    }
    pv_node_t *as = pv_new_dict(doc);
    pv_dict_set(doc, as, "PYTORCH_CUDA_ALLOC_CONF", pv_new_str(doc, conf.data ? conf.data : ""));
    pv_dict_set(doc, as, "max_split_size",
                pv_new_int(doc, s->max_split_size == SIZE_MAX ? -1 : (int64_t)s->max_split_size));
    pv_dict_set(doc, as, "garbage_collection_threshold", pv_new_float(doc, s->garbage_collection_threshold));
    pv_dict_set(doc, as, "expandable_segments", pv_new_bool(doc, s->expandable_segments));
    pv_dict_set(doc, as, "pinned_num_register_threads", pv_uint(doc, s->pinned_num_register_threads));
    pv_dict_set(doc, as, "release_lock_on_cudamalloc", pv_new_bool(doc, s->release_lock_on_cudamalloc));
    pv_dict_set(doc, as, "pinned_use_cuda_host_register", pv_new_bool(doc, s->pinned_use_cuda_host_register));
    pv_dict_set(doc, as, "graph_capture_record_stream_reuse",
                pv_new_bool(doc, s->graph_capture_record_stream_reuse));
    pv_node_t *rd = pv_new_dict(doc);
    for (int i = 0; i < CCA_ROUNDUP_INTERVALS; i++) {
        char key[16];
        snprintf(key, sizeof(key), "%d", 1 << i);
        pv_dict_set(doc, rd, key, pv_uint(doc, s->roundup_power2_divisions[i]));
    }
    pv_dict_set(doc, as, "roundup_power2_divisions", rd);
    cca_status_t st = pv_dict_set(doc, root, "allocator_settings", as);
    if (st == CCA_OK) {
        /* what cca replay reads back: the settings string and the device */
        pv_node_t *meta = pv_new_dict(doc);
        pv_dict_set(doc, meta, "conf", pv_new_str(doc, conf.data ? conf.data : ""));
        pv_dict_set(doc, meta, "total_memory", pv_uint(doc, parts->total_memory));
        if (parts->fraction > 0.0)
            pv_dict_set(doc, meta, "fraction", pv_new_float(doc, parts->fraction));
        st = pv_dict_set(doc, root, "cca_meta", meta);
    }
    sb_free(&conf);
    return st;
}

cca_status_t snapshot_tree(const snapshot_parts_t *parts, pv_doc_t **out)
{
    cca_status_t st;
    pv_doc_t *doc = pv_doc_new();
    if (!doc)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory writing a snapshot");
    /* a node that cannot be built raises; a raise anywhere in the tree fails the build */
    cca_clear_error();
    pv_node_t *root = pv_new_dict(doc);
    pv_node_t *segments = pv_new_list(doc);
    pv_node_t *traces = pv_new_list(doc);
    pv_node_t *annotations = pv_new_list(doc);
    st = pv_dict_set(doc, root, "segments", segments);
    if (st == CCA_OK)
        st = pv_dict_set(doc, root, "device_traces", traces);
    if (st == CCA_OK)
        st = add_segments(doc, segments, parts->snapshot);
    if (st == CCA_OK)
        st = add_traces(doc, traces, annotations, parts->entries, parts->entry_count, parts->device_count);
    if (st == CCA_OK)
        st = add_settings(doc, root, parts);
    if (st == CCA_OK)
        st = pv_dict_set(doc, root, "external_annotations", annotations);
    if (st == CCA_OK && cca_last_error()->status != CCA_OK)
        st = cca_last_error()->status;
    if (st != CCA_OK) {
        if (st == CCA_ERR_OUT_OF_MEMORY && cca_last_error()->status != CCA_ERR_OUT_OF_MEMORY)
            st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory writing a snapshot");
        pv_doc_free(doc);
        return st;
    }
    pv_doc_set_root(doc, root);
    *out = doc;
    return CCA_OK;
}

/* Write text to path. Returns CCA_OK or CCA_ERR_IO. */
cca_status_t snapshot_write_text(const char *path, const char *text, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return cca_raise(CCA_ERR_IO, "cannot open %s for writing: %s", path, strerror(errno));
    size_t written = fwrite(text, 1, len, f);
    int err = ferror(f);
    if (fclose(f) != 0 || written != len || err)
        return cca_raise(CCA_ERR_IO, "cannot write %s: %s", path, strerror(errno));
    return CCA_OK;
}

cca_status_t snapshot_check_path(const char *path, const char *what)
{
    if (!path || !*path)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: path is NULL or empty", what);
    return CCA_OK;
}

/* Render a snapshot tree as JSON or SVG into sb. */
static cca_status_t render(const pv_node_t *root, bool svg, cca_strbuf_t *sb)
{
    cca_status_t st = svg ? svg_render(root, sb) : pv_to_json(root, sb, true);
    if (st == CCA_OK && !svg)
        sb_append(sb, "\n");
    if (st == CCA_OK && (sb->failed || !sb->data))
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory rendering a snapshot");
    return st;
}

cca_status_t snapshot_write_doc(const pv_doc_t *doc, snapshot_format_t format, const char *path)
{
    if (format == SNAPSHOT_PICKLE)
        return pickle_write_file(pv_doc_root(doc), path);
    cca_strbuf_t sb;
    sb_init(&sb);
    cca_status_t st = render(pv_doc_root(doc), format == SNAPSHOT_SVG, &sb);
    if (st == CCA_OK)
        st = snapshot_write_text(path, sb.data, sb.len);
    sb_free(&sb);
    return st;
}

/* Load a snapshot file and check its shape. */
static cca_status_t load_snapshot(const char *path, pv_doc_t **out)
{
    pv_doc_t *doc = NULL;
    cca_status_t st = pickle_load_file(path, &doc);
    if (st != CCA_OK)
        return st;
    const pv_node_t *root = pv_doc_root(doc);
    const pv_node_t *segments = root ? pv_dict_get(root, "segments") : NULL;
    if (!segments || pv_kind(segments) != PV_LIST) {
        pv_doc_free(doc);
        return cca_raise(CCA_ERR_FORMAT, "%s is not a memory snapshot (no segments list)", path);
    }
    *out = doc;
    return CCA_OK;
}

cca_status_t cca_snapshot_file_to_json(const char *in_path, char **text)
{
    cca_status_t st = snapshot_check_path(in_path, "cca_snapshot_file_to_json");
    if (st != CCA_OK)
        return st;
    if (!text)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_snapshot_file_to_json: text is NULL");
    pv_doc_t *doc = NULL;
    st = load_snapshot(in_path, &doc);
    if (st != CCA_OK)
        return st;
    cca_strbuf_t sb;
    sb_init(&sb);
    st = render(pv_doc_root(doc), false, &sb);
    pv_doc_free(doc);
    if (st != CCA_OK) {
        sb_free(&sb);
        return st;
    }
    *text = sb.data;
    return CCA_OK;
}

cca_status_t cca_snapshot_file_to_svg(const char *in_path, const char *svg_path)
{
    cca_status_t st = snapshot_check_path(in_path, "cca_snapshot_file_to_svg");
    if (st == CCA_OK)
        st = snapshot_check_path(svg_path, "cca_snapshot_file_to_svg");
    if (st != CCA_OK)
        return st;
    pv_doc_t *doc = NULL;
    st = load_snapshot(in_path, &doc);
    if (st != CCA_OK)
        return st;
    cca_strbuf_t sb;
    sb_init(&sb);
    st = render(pv_doc_root(doc), true, &sb);
    if (st == CCA_OK)
        st = snapshot_write_text(svg_path, sb.data, sb.len);
    sb_free(&sb);
    pv_doc_free(doc);
    return st;
}
