/*
 * fuzz_pickle.c - fuzz target for the pickle reader, writer and JSON: any
 * input either loads or fails cleanly; a loaded tree is written back, and the
 * rewrite must load again, compare equal to the first tree, and be a fixed
 * point of the writer (writing the reloaded tree gives the same bytes).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pickle.h"

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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    pv_doc_t *doc = NULL, *again = NULL;
    cca_strbuf_t first, second, json;
    sb_init(&first);
    sb_init(&second);
    sb_init(&json);
    if (pickle_load_buffer(data, size, &doc) != CCA_OK)
        goto out;
    const pv_node_t *root = pv_doc_root(doc);
    (void)pv_dict_get(root, "device_traces");
    /* JSON expands shared nodes, so only small inputs (bounded expansion) go through it. */
    if (size < 512 && pv_to_json(root, &json, size & 1) == CCA_OK && json.len == 0)
        abort();
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
