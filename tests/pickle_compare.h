/*
 * pickle_compare.h - whether a streamed record's value (pk_value_t) is what the
 * tree reader made of the same pickle (pv_node_t): scalars by value, containers
 * by kind only (their content is not kept in a record). Shared by the pickle
 * stream's unit test and its fuzz target.
 */
#ifndef CCA_TEST_PICKLE_COMPARE_H
#define CCA_TEST_PICKLE_COMPARE_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "pickle.h"
#include "pickle_stream.h"

static inline bool pickle_value_is(const pk_value_t *v, const pv_node_t *n)
{
    if (v->kind != pv_kind(n))
        return false;
    int64_t i;
    uint64_t u;
    double d;
    bool b;
    const char *s;
    const uint8_t *bytes;
    size_t len;
    switch (pv_kind(n)) {
    case PV_NONE: return true;
    case PV_BOOL: return pv_get_bool(n, &b) && v->num.b == b;
    case PV_INT:
        if (pv_get_int(n, &i))
            return !v->is_u64 && v->num.i == i;
        return v->is_u64 && pv_get_u64(n, &u) && v->num.u == u;
    case PV_FLOAT: return pv_get_double(n, &d) && !memcmp(&d, &v->num.f, sizeof(d));
    case PV_STR: return pv_get_str(n, &s, &len) && len == v->len && !memcmp(s, v->data, len);
    case PV_BYTES: return pv_get_bytes(n, &bytes, &len) && len == v->len && !memcmp(bytes, v->data, len);
    case PV_BIGINT: return pv_get_bigint(n, &bytes, &len) && len == v->len && !memcmp(bytes, v->data, len);
    default: return v->data == NULL;
    }
}

#endif
