/*
 * fuzz_pickle.c - fuzz target for the pickle reader, writer and JSON, and the
 * streaming reader: any input either loads or fails cleanly; a loaded tree is
 * written back, and the rewrite must load again, compare equal to the first
 * tree, and be a fixed point of the writer (writing the reloaded tree gives
 * the same bytes). The streaming reader, keeping everything as a tree (whole,
 * and one byte at a time), must give the tree reader's tree whenever it
 * succeeds; streaming `device_traces` as records, it must hand over exactly
 * the dicts of the tree reader's device_traces when both succeed, field by
 * field, and by_tag must hold each symbol's value (records shared through the
 * memo included: each handed over at each place, once). JSON is bounded: a
 * pickle sharing containers within containers is refused, not expanded.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pickle.h"
#include "pickle_stream.h"
#include "pickle_compare.h"

/* Structural equality with a work budget (trees may share nodes or be cyclic). */
static bool same_tree(const pv_node_t *a, const pv_node_t *b, int depth, long *budget)
{
    if (--*budget < 0 || depth > 200)
        return true; /* out of budget: the byte comparison still checks the rest */
    if (pv_kind(a) != pv_kind(b) || pv_len(a) != pv_len(b))
        return false;
    int64_t ia, ib;
    uint64_t ua, ub;
    double da, db;
    bool ba, bb;
    const uint8_t *pa, *pb;
    const char *sa, *sb;
    size_t la, lb;
    switch (pv_kind(a)) {
    case PV_NONE: return true;
    case PV_BOOL: return pv_get_bool(a, &ba) && pv_get_bool(b, &bb) && ba == bb;
    case PV_INT:
        if (pv_get_int(a, &ia))
            return pv_get_int(b, &ib) && ia == ib;
        return pv_get_u64(a, &ua) && pv_get_u64(b, &ub) && ua == ub && pv_is_u64(b);
    case PV_FLOAT:
        pv_get_double(a, &da);
        pv_get_double(b, &db);
        return memcmp(&da, &db, sizeof(da)) == 0;
    case PV_STR:
        return pv_get_str(a, &sa, &la) && pv_get_str(b, &sb, &lb) && la == lb &&
               memcmp(sa, sb, la) == 0;
    case PV_BYTES:
        return pv_get_bytes(a, &pa, &la) && pv_get_bytes(b, &pb, &lb) && memcmp(pa, pb, la) == 0;
    case PV_BIGINT:
        return pv_get_bigint(a, &pa, &la) && pv_get_bigint(b, &pb, &lb) && memcmp(pa, pb, la) == 0;
    case PV_LIST:
    case PV_TUPLE:
        for (size_t i = 0; i < pv_len(a); i++)
            if (!same_tree(pv_at(a, i), pv_at(b, i), depth + 1, budget))
                return false;
        return true;
    case PV_DICT:
        for (size_t i = 0; i < pv_len(a); i++)
            if (!same_tree(pv_dict_key_at(a, i), pv_dict_key_at(b, i), depth + 1, budget) ||
                !same_tree(pv_dict_value_at(a, i), pv_dict_value_at(b, i), depth + 1, budget))
                return false;
        return true;
    }
    return false;
}

static pk_mode_t all_tree(void *ctx, const char *key, size_t len)
{
    (void)ctx, (void)key, (void)len;
    return PK_TREE;
}

typedef struct seen {
    const pv_node_t *traces; /* the tree reader's device_traces */
    size_t records, bad;
    size_t occurrences;      /* device_traces fields met (a repeated key streams each) */
} seen_t;

static pk_mode_t traces_as_records(void *ctx, const char *key, size_t len)
{
    seen_t *s = ctx;
    if (len == 13 && !memcmp(key, "device_traces", 13)) {
        s->occurrences++;
        return PK_RECORDS;
    }
    return PK_TREE;
}

/* Keys the records are read with as symbols (by_tag checked against the tree's dict). */
static const char *const record_syms[] = {"action", "addr", "size", "a", "b", ""};

static cca_status_t check_record(void *ctx, const pk_record_t *rec)
{
    seen_t *s = ctx;
    const pv_node_t *outer = s->traces;
    const pv_node_t *inner = outer ? pv_at(outer, rec->group) : NULL;
    const pv_node_t *d = NULL;
    if (inner && pv_kind(inner) == PV_LIST)
        d = pv_at(inner, rec->index);
    else if (outer && rec->group == 0)
        d = pv_at(outer, rec->index); /* a flat list of records */
    /* a key written twice is one entry of the tree's dict, two fields of the record */
    if (!d || pv_kind(d) != PV_DICT || pv_len(d) > rec->count || (pv_len(d) == 0) != (rec->count == 0))
        s->bad++;
    else if (pv_len(d) == rec->count)
        for (size_t i = 0; i < rec->count; i++) {
            pk_field_t f;
            if (!pk_record_field(rec, i, &f) || !pickle_value_is(&f.key, pv_dict_key_at(d, i)) ||
                !pickle_value_is(&f.value, pv_dict_value_at(d, i)))
                s->bad++;
        }
    /* by_tag: the value of each symbol's key (the dict keeps a repeated key's last) */
    for (size_t t = 0; d && pv_kind(d) == PV_DICT && t < sizeof(record_syms) / sizeof(record_syms[0]); t++) {
        const pv_node_t *want = pv_dict_get(d, record_syms[t]);
        if ((want == NULL) != (rec->by_tag[t] == NULL) || (want && !pickle_value_is(rec->by_tag[t], want)))
            s->bad++;
    }
    s->records++;
    return CCA_OK;
}

/* The streaming reader against the tree reader's result (doc: NULL if it failed). */
static void check_stream(const uint8_t *data, size_t size, const pv_doc_t *doc)
{
    static const size_t chunks[] = {0, 1};
    for (size_t k = 0; k < 2; k++) {
        pk_handler_t h = {.field_mode = all_tree};
        pv_doc_t *streamed = NULL;
        if (pickle_stream_buffer(data, size, chunks[k], &h, &streamed) == CCA_OK) {
            long budget = 100000;
            if (!doc || !same_tree(pv_doc_root(doc), pv_doc_root(streamed), 0, &budget))
                abort();
        }
        pv_doc_free(streamed);
    }
    const pv_node_t *root = doc ? pv_doc_root(doc) : NULL;
    seen_t seen = {.traces = root && pv_kind(root) == PV_DICT ? pv_dict_get(root, "device_traces") : NULL};
    pk_handler_t h = {.ctx = &seen, .symbols = record_syms,
                      .symbol_count = sizeof(record_syms) / sizeof(record_syms[0]),
                      .field_mode = traces_as_records, .record = check_record};
    pv_doc_t *fields = NULL;
    if (pickle_stream_buffer(data, size, 0, &h, &fields) == CCA_OK && doc && seen.traces &&
        seen.occurrences == 1) {
        size_t want = 0;
        bool nested = pv_len(seen.traces) && pv_kind(pv_at(seen.traces, 0)) == PV_LIST;
        for (size_t g = 0; g < pv_len(seen.traces); g++)
            want += nested ? pv_len(pv_at(seen.traces, g)) : 1;
        if (seen.bad || seen.records != want)
            abort();
    }
    pv_doc_free(fields);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    pv_doc_t *doc = NULL, *again = NULL;
    cca_strbuf_t first, second, json;
    sb_init(&first);
    sb_init(&second);
    sb_init(&json);
    if (pickle_load_buffer(data, size, &doc) != CCA_OK) {
        check_stream(data, size, NULL);
        goto out;
    }
    check_stream(data, size, doc);
    const pv_node_t *root = pv_doc_root(doc);
    (void)pv_dict_get(root, "device_traces");
    /* JSON writes a shared node at each place: the values it would write are counted
     * first, and a text past its bound (2^20 values and 64 times the distinct ones) is
     * refused, never written; small inputs, and those refused, go through it. */
    uint64_t values = 0, distinct = 0;
    if (pv_json_values(root, &values, &distinct) == CCA_OK) {
        bool over = values > ((uint64_t)1 << 20) && values / 64 > distinct;
        if (over || size < 512) {
            cca_status_t js = pv_to_json(root, &json, size & 1);
            if (over != (js == CCA_ERR_FORMAT) || (js == CCA_OK && json.len < values))
                abort();
        }
    }
    cca_status_t st = pickle_write_buffer(root, &first);
    if (st != CCA_OK) {
        /* Only nesting beyond PV_MAX_DEPTH (or a cycle through tuples) may fail. */
        if (st != CCA_ERR_INVALID_ARGUMENT)
            abort();
        goto out;
    }
    if (pickle_load_buffer(first.data, first.len, &again) != CCA_OK)
        abort();
    long budget = 100000;
    if (!same_tree(root, pv_doc_root(again), 0, &budget))
        abort();
    if (pickle_write_buffer(pv_doc_root(again), &second) != CCA_OK)
        abort();
    if (second.len != first.len || memcmp(first.data, second.data, first.len) != 0)
        abort();
out:
    sb_free(&json);
    sb_free(&second);
    sb_free(&first);
    pv_doc_free(again);
    pv_doc_free(doc);
    return 0;
}
