/*
 * json.c - JSON rendering of pickle value trees (pv_to_json) and decimal
 * digits of big ints. Output is always valid JSON (RFC 8259): strings are
 * escaped (lone surrogates as \uXXXX), non-finite floats become null, and
 * recursion stops at PV_MAX_DEPTH so a cyclic tree is an error, not a crash.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pickle.h"

void pv_bigint_to_decimal(const uint8_t *data, size_t len, cca_strbuf_t *out)
{
    if (len == 0) {
        sb_append(out, "0");
        return;
    }
    bool negative = (data[len - 1] & 0x80) != 0;
    /* Magnitude as little-endian 32-bit limbs. */
    size_t nlimbs = (len + 3) / 4;
    uint32_t *limbs = calloc(nlimbs, sizeof(*limbs));
    char *digits = malloc(nlimbs * 10 + 2);
    if (!limbs || !digits) {
        out->failed = true;
        goto out_free;
    }
    for (size_t i = 0; i < len; i++) {
        uint8_t b = negative ? (uint8_t)~data[i] : data[i];
        limbs[i / 4] |= (uint32_t)b << (8 * (i % 4));
    }
    if (negative) { /* two's complement: magnitude = ~x + 1 */
        for (size_t i = len; i < nlimbs * 4; i++)
            limbs[i / 4] &= ~((uint32_t)0xff << (8 * (i % 4)));
        for (size_t i = 0; i < nlimbs && ++limbs[i] == 0; i++)
            ;
    }
    size_t ndigits = 0;
    size_t top = nlimbs;
    while (top && limbs[top - 1] == 0)
        top--;
    while (top) {
        uint64_t rem = 0;
        for (size_t i = top; i-- > 0;) {
            uint64_t cur = (rem << 32) | limbs[i];
            limbs[i] = (uint32_t)(cur / 1000000000u);
            rem = cur % 1000000000u;
        }
        while (top && limbs[top - 1] == 0)
            top--;
        for (int k = 0; k < 9 && (top || rem); k++) {
            digits[ndigits++] = (char)('0' + rem % 10);
            rem /= 10;
        }
    }
    if (!ndigits)
        digits[ndigits++] = '0';
    if (negative)
        digits[ndigits++] = '-';
    for (size_t i = 0; i < ndigits / 2; i++) {
        char c = digits[i];
        digits[i] = digits[ndigits - 1 - i];
        digits[ndigits - 1 - i] = c;
    }
    sb_appendn(out, digits, ndigits);
out_free:
    free(limbs);
    free(digits);
}

/* A JSON string literal of len bytes of UTF-8 (surrogate code points escaped). */
static void json_string(cca_strbuf_t *out, const char *s, size_t len)
{
    sb_appendn(out, "\"", 1);
    size_t run = 0; /* start of the pending run of bytes copied verbatim */
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char buf[8];
        size_t skip = 1;
        if (c == '"')
            esc = "\\\"";
        else if (c == '\\')
            esc = "\\\\";
        else if (c == '\n')
            esc = "\\n";
        else if (c == '\r')
            esc = "\\r";
        else if (c == '\t')
            esc = "\\t";
        else if (c < 0x20) {
            snprintf(buf, sizeof(buf), "\\u%04x", c);
            esc = buf;
        } else if (c == 0xed && i + 2 < len && (unsigned char)s[i + 1] >= 0xa0) {
            /* A surrogate (U+D800..U+DFFF), which JSON cannot carry raw. */
            unsigned cp = 0xd000u | (((unsigned char)s[i + 1] & 0x3fu) << 6) | ((unsigned char)s[i + 2] & 0x3fu);
            snprintf(buf, sizeof(buf), "\\u%04x", cp);
            esc = buf;
            skip = 3;
        }
        if (!esc)
            continue;
        sb_appendn(out, s + run, i - run);
        sb_append(out, esc);
        i += skip - 1;
        run = i + 1;
    }
    sb_appendn(out, s + run, len - run);
    sb_appendn(out, "\"", 1);
}

static void json_base64(cca_strbuf_t *out, const uint8_t *p, size_t n)
{
    static const char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    sb_appendn(out, "\"", 1);
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)p[i] << 16;
        if (i + 1 < n)
            v |= (uint32_t)p[i + 1] << 8;
        if (i + 2 < n)
            v |= p[i + 2];
        char q[4] = {alphabet[(v >> 18) & 63], alphabet[(v >> 12) & 63],
                     i + 1 < n ? alphabet[(v >> 6) & 63] : '=', i + 2 < n ? alphabet[v & 63] : '='};
        sb_appendn(out, q, 4);
    }
    sb_appendn(out, "\"", 1);
}

/* The shortest "%.*g" that reads back as the same double, with '.' or 'e'. */
static void json_float(cca_strbuf_t *out, double d)
{
    if (!isfinite(d)) {
        sb_append(out, "null");
        return;
    }
    char buf[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof(buf), "%.*g", prec, d);
        if (strtod(buf, NULL) == d)
            break;
    }
    if (!strpbrk(buf, ".eE"))
        strcat(buf, ".0");
    sb_append(out, buf);
}

static void json_indent(cca_strbuf_t *out, bool pretty, int depth)
{
    if (!pretty)
        return;
    sb_appendn(out, "\n", 1);
    for (int i = 0; i < depth; i++)
        sb_appendn(out, "  ", 2);
}

static cca_status_t json_node(const pv_node_t *n, cca_strbuf_t *out, bool pretty, int depth);

/* A dict key: a str as itself, anything else as the string of its compact JSON. */
static cca_status_t json_key(const pv_node_t *k, cca_strbuf_t *out, int depth)
{
    const char *s;
    size_t len;
    if (pv_get_str(k, &s, &len)) {
        json_string(out, s, len);
        return CCA_OK;
    }
    if (pv_kind(k) == PV_BYTES) /* already a string: its base64 text */
        return json_node(k, out, false, depth);
    cca_strbuf_t text;
    sb_init(&text);
    cca_status_t st = json_node(k, &text, false, depth);
    if (!st && text.failed)
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "json: out of memory");
    if (!st)
        json_string(out, text.data, text.len);
    sb_free(&text);
    return st;
}

static cca_status_t json_node(const pv_node_t *n, cca_strbuf_t *out, bool pretty, int depth)
{
    cca_status_t st;
    if (depth > PV_MAX_DEPTH)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "json: value nested deeper than %d levels (a cycle?)",
                         PV_MAX_DEPTH);
    if (out->failed)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "json: out of memory");
    bool b;
    int64_t i64;
    uint64_t u64;
    double d;
    const char *s;
    const uint8_t *bytes;
    size_t len;
    switch (pv_kind(n)) {
    case PV_NONE: sb_append(out, "null"); return CCA_OK;
    case PV_BOOL: pv_get_bool(n, &b); sb_append(out, b ? "true" : "false"); return CCA_OK;
    case PV_INT:
        if (pv_get_int(n, &i64))
            sb_printf(out, "%lld", (long long)i64);
        else if (pv_get_u64(n, &u64))
            sb_printf(out, "%llu", (unsigned long long)u64);
        return CCA_OK;
    case PV_BIGINT: pv_get_bigint(n, &bytes, &len); pv_bigint_to_decimal(bytes, len, out); return CCA_OK;
    case PV_FLOAT: pv_get_double(n, &d); json_float(out, d); return CCA_OK;
    case PV_STR: pv_get_str(n, &s, &len); json_string(out, s, len); return CCA_OK;
    case PV_BYTES: pv_get_bytes(n, &bytes, &len); json_base64(out, bytes, len); return CCA_OK;
    case PV_LIST:
    case PV_TUPLE:
        len = pv_len(n);
        sb_appendn(out, "[", 1);
        for (size_t i = 0; i < len; i++) {
            if (i)
                sb_appendn(out, ",", 1);
            json_indent(out, pretty, depth + 1);
            if ((st = json_node(pv_at(n, i), out, pretty, depth + 1)))
                return st;
        }
        if (len)
            json_indent(out, pretty, depth);
        sb_appendn(out, "]", 1);
        return CCA_OK;
    case PV_DICT:
        len = pv_len(n);
        sb_appendn(out, "{", 1);
        for (size_t i = 0; i < len; i++) {
            if (i)
                sb_appendn(out, ",", 1);
            json_indent(out, pretty, depth + 1);
            if ((st = json_key(pv_dict_key_at(n, i), out, depth + 1)))
                return st;
            sb_append(out, pretty ? ": " : ":");
            if ((st = json_node(pv_dict_value_at(n, i), out, pretty, depth + 1)))
                return st;
        }
        if (len)
            json_indent(out, pretty, depth);
        sb_appendn(out, "}", 1);
        return CCA_OK;
    }
    return cca_raise(CCA_ERR_INTERNAL, "json: unknown node kind");
}

/* ---- the size of the rendering --------------------------------------------------------------- */

/*
 * A pickle's memo lets containers be shared, and JSON writes a shared value at
 * each place: 40 lists each holding the next one twice are 467 bytes of pickle
 * and 2^40 values of JSON. Before writing, the values the text would hold are
 * counted (each container once, its count remembered by address), and a text
 * more than JSON_EXPANSION_MAX times the distinct values (and past
 * JSON_VALUES_FREE) is refused: what is written stays proportional to the
 * pickle. (The 52 real snapshots of tests/data and ../shared/traces share
 * nothing: their ratio is 1.00.)
 */
#define JSON_EXPANSION_MAX 64
#define JSON_VALUES_FREE ((uint64_t)1 << 20)

typedef struct counted {
    const pv_node_t *node; /* NULL: an empty slot */
    uint64_t values;       /* values its rendering holds, itself included */
} counted_t;

typedef struct json_count {
    counted_t *slots;
    size_t cap, used;
    uint64_t distinct;     /* values with each container counted once */
    bool failed;           /* out of memory */
} json_count_t;

static size_t count_slot(const json_count_t *c, const pv_node_t *n)
{
    uint64_t h = (uint64_t)(uintptr_t)n * 0x9e3779b97f4a7c15ull;
    size_t i = (size_t)(h >> 17) & (c->cap - 1);
    while (c->slots[i].node && c->slots[i].node != n)
        i = (i + 1) & (c->cap - 1);
    return i;
}

static bool count_grow(json_count_t *c)
{
    size_t cap = c->cap ? c->cap * 2 : 1024;
    counted_t *old = c->slots;
    size_t old_cap = c->cap;
    if (!(c->slots = calloc(cap, sizeof(*c->slots)))) {
        c->slots = old;
        return false;
    }
    c->cap = cap;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i].node)
            c->slots[count_slot(c, old[i].node)] = old[i];
    free(old);
    return true;
}

static uint64_t add_sat(uint64_t a, uint64_t b)
{
    return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

/* Values the rendering of n holds (saturating); 0 on an error (raised). */
static uint64_t count_values(json_count_t *c, const pv_node_t *n, int depth)
{
    pv_kind_t kind = pv_kind(n);
    if (kind != PV_LIST && kind != PV_TUPLE && kind != PV_DICT) {
        c->distinct++;
        return 1;
    }
    if (depth > PV_MAX_DEPTH) {
        cca_raise(CCA_ERR_INVALID_ARGUMENT, "json: value nested deeper than %d levels (a cycle?)",
                  PV_MAX_DEPTH);
        return 0;
    }
    if (c->cap) {
        size_t i = count_slot(c, n);
        if (c->slots[i].node)
            return c->slots[i].values; /* met before: written again, counted once */
    }
    c->distinct++;
    uint64_t values = 1;
    size_t len = pv_len(n);
    for (size_t i = 0; i < len; i++) {
        uint64_t v = kind == PV_DICT ? count_values(c, pv_dict_value_at(n, i), depth + 1)
                                     : count_values(c, pv_at(n, i), depth + 1);
        if (!v)
            return 0;
        values = add_sat(values, v);
        if (kind == PV_DICT) { /* its key */
            uint64_t k = count_values(c, pv_dict_key_at(n, i), depth + 1);
            if (!k)
                return 0;
            values = add_sat(values, k);
        }
    }
    if ((c->used + 1) * 2 > c->cap && !count_grow(c)) {
        cca_raise(CCA_ERR_OUT_OF_MEMORY, "json: out of memory");
        return 0;
    }
    size_t i = count_slot(c, n);
    c->slots[i].node = n;
    c->slots[i].values = values;
    c->used++;
    return values;
}

cca_status_t pv_json_values(const pv_node_t *node, uint64_t *values, uint64_t *distinct)
{
    json_count_t c = {0};
    uint64_t v = count_values(&c, node, 0);
    free(c.slots);
    if (!v)
        return cca_last_error()->status;
    *values = v;
    *distinct = c.distinct;
    return CCA_OK;
}

cca_status_t pv_to_json(const pv_node_t *node, cca_strbuf_t *out, bool pretty)
{
    if (!node || !out)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pv_to_json: NULL argument");
    uint64_t values = 0, distinct = 0;
    cca_status_t st = pv_json_values(node, &values, &distinct);
    if (st)
        return st;
    if (values > JSON_VALUES_FREE && values / JSON_EXPANSION_MAX > distinct)
        return cca_raise(CCA_ERR_FORMAT,
                         "json: shared values would be written %llu times over: %llu values from "
                         "%llu distinct ones (more than %d times; a pickle whose memo shares "
                         "containers within containers?)",
                         (unsigned long long)(values / distinct), (unsigned long long)values,
                         (unsigned long long)distinct, JSON_EXPANSION_MAX);
    st = json_node(node, out, pretty, 0);
    if (!st && out->failed)
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "json: out of memory");
    return st;
}
