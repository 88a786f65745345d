/*
 * pickle.c - Python pickle values (pv_*): the arena-backed value tree, its
 * hashing and key equality, dicts and lists, accessors and builders. The
 * reader (protocols 0-5, plain data opcodes only) is the decoder of
 * pickle_decode.h (pickle_load_* in pickle_reader.c), the protocol-4 writer
 * used for PyTorch memory snapshots pickle_write.c.
 *
 * Invariants: every node, string and item array of a document lives in its
 * arena and dies with it; a dict holds each key at most once (Python's
 * equality), and a dict with more than DICT_INDEX_MIN slots carries a hash
 * index of its keys, rebuilt whenever its pair array grows.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>

#include "pickle_internal.h"

/* ---- nodes and the arena -------------------------------------------------------- */

#define ARENA_FIRST_CHUNK ((size_t)64 * 1024)
#define ARENA_MAX_CHUNK ((size_t)8 * 1024 * 1024)
#define ARENA_ALIGN 8

void *pv_arena_alloc(pv_doc_t *doc, size_t size)
{
    size = (size + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
    if ((size_t)(doc->end - doc->cur) >= size) {
        void *p = doc->cur;
        doc->cur += size;
        return p;
    }
    size_t chunk = doc->next_chunk;
    bool dedicated = size > chunk / 4;
    if (dedicated)
        chunk = size;
    if (chunk > SIZE_MAX - sizeof(arena_chunk_t) - ARENA_ALIGN)
        return NULL;
    arena_chunk_t *c = malloc(sizeof(arena_chunk_t) + chunk);
    if (!c)
        return NULL;
    c->size = chunk;
    doc->arena_bytes += chunk;
    char *base = (char *)(c + 1);
    if (dedicated && doc->chunks) {
        /* Keep bumping in the current chunk; this one holds a single block. */
        c->next = doc->chunks->next;
        doc->chunks->next = c;
        return base;
    }
    c->next = doc->chunks;
    doc->chunks = c;
    doc->cur = base + size;
    doc->end = base + chunk;
    if (!dedicated && doc->next_chunk < ARENA_MAX_CHUNK)
        doc->next_chunk *= 2;
    return base;
}

pv_doc_t *pv_doc_new(void)
{
    pv_doc_t *doc = calloc(1, sizeof(*doc));
    if (!doc)
        return NULL;
    doc->next_chunk = ARENA_FIRST_CHUNK;
    return doc;
}

void pv_doc_free(pv_doc_t *doc)
{
    if (!doc)
        return;
    for (arena_chunk_t *c = doc->chunks, *next; c; c = next) {
        next = c->next;
        free(c);
    }
    free(doc->interned);
    free(doc);
}

const pv_node_t *pv_doc_root(const pv_doc_t *doc)
{
    return doc ? doc->root : NULL;
}

void pv_doc_set_root(pv_doc_t *doc, pv_node_t *root)
{
    doc->root = root;
}

size_t pv_doc_arena_bytes(const pv_doc_t *doc)
{
    return doc->arena_bytes;
}

pv_node_t *pv_node_alloc(pv_doc_t *doc, pv_kind_t kind)
{
    pv_node_t *n = pv_arena_alloc(doc, sizeof(pv_node_t));
    if (!n)
        return NULL;
    memset(n, 0, sizeof(*n));
    n->kind = (uint8_t)kind;
    return n;
}

/* A node holding a NUL-terminated arena copy of data. */
pv_node_t *pv_node_bytes(pv_doc_t *doc, pv_kind_t kind, const void *data, size_t len)
{
    if (len >= SIZE_MAX - 16)
        return NULL;
    pv_node_t *n = pv_node_alloc(doc, kind);
    char *copy = n ? pv_arena_alloc(doc, len + 1) : NULL;
    if (!copy)
        return NULL;
    if (len)
        memcpy(copy, data, len);
    copy[len] = '\0';
    n->v.s.data = copy;
    n->v.s.len = len;
    return n;
}

/* ---- hashing and key equality ------------------------------------------------------- */

uint64_t pv_mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

uint64_t pv_hash_mem(const void *data, size_t len)
{
    const unsigned char *p = data;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < len; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

/*
 * Numbers as Python compares them: class 1 = an integer within int64 (bits is
 * the value), 2 = an integer in [2^63, 2^64), 3 = any other float (compared
 * as a double), 0 = not a number. Integral floats join the integer classes.
 */
static int num_class(const pv_node_t *n, uint64_t *bits, double *f)
{
    switch (n->kind) {
    case PV_BOOL: *bits = n->v.b; return 1;
    case PV_INT: *bits = n->v.u; return (n->flags & PVF_U64) ? 2 : 1;
    case PV_FLOAT: {
        double d = n->v.f;
        if (d == floor(d) && d >= -9223372036854775808.0 && d < 9223372036854775808.0) {
            *bits = (uint64_t)(int64_t)d;
            return 1;
        }
        if (d == floor(d) && d >= 9223372036854775808.0 && d < 18446744073709551616.0) {
            *bits = (uint64_t)d;
            return 2;
        }
        *f = d;
        memcpy(bits, &d, sizeof(*bits));
        return 3;
    }
    default: return 0;
    }
}

/* Whether a node may be a dict key (Python's hashability for these kinds). */
/*
 * Tuple keys are walked with a work budget (KEY_BUDGET nodes per call): shared
 * sub-tuples could otherwise make a small pickle's key exponentially large.
 * The walks visit nodes in structural order, so equal keys spend the budget
 * alike and still hash alike; a key too large to check is refused.
 */
#define KEY_BUDGET 4096

/* Whether a node may be a dict key (Python's hashability for these kinds). */
static bool key_hashable(const pv_node_t *n, int depth, long *budget)
{
    if (n->kind == PV_LIST || n->kind == PV_DICT)
        return false;
    if (n->kind != PV_TUPLE)
        return true;
    if (depth >= KEY_DEPTH_MAX || (*budget -= 1 + (long)n->v.seq.len) < 0)
        return false;
    for (uint32_t i = 0; i < n->v.seq.len; i++)
        if (!key_hashable(n->v.seq.items[i], depth + 1, budget))
            return false;
    return true;
}

bool pv_key_ok(const pv_node_t *n)
{
    long budget = KEY_BUDGET;
    return key_hashable(n, 0, &budget);
}

static uint64_t key_hash_walk(const pv_node_t *n, int depth, long *budget)
{
    uint64_t bits = 0;
    double f;
    int cls = num_class(n, &bits, &f);
    if (cls)
        return pv_mix64(bits + (uint64_t)cls);
    switch (n->kind) {
    case PV_STR: return pv_hash_mem(n->v.s.data, n->v.s.len);
    case PV_BYTES: return pv_hash_mem(n->v.s.data, n->v.s.len) ^ 0x5bd1e995u;
    case PV_BIGINT: return pv_hash_mem(n->v.s.data, n->v.s.len) ^ 0x27d4eb2fu;
    case PV_TUPLE: {
        uint64_t h = pv_mix64(0x7475706cu + n->v.seq.len);
        if (depth < KEY_DEPTH_MAX && (*budget -= 1 + (long)n->v.seq.len) >= 0)
            for (uint32_t i = 0; i < n->v.seq.len; i++)
                h = pv_mix64(h ^ key_hash_walk(n->v.seq.items[i], depth + 1, budget));
        return h;
    }
    default: return 0x9e3779b97f4a7c15ull; /* None */
    }
}

static uint64_t key_hash(const pv_node_t *n)
{
    long budget = KEY_BUDGET;
    return key_hash_walk(n, 0, &budget);
}

static bool key_equal_walk(const pv_node_t *a, const pv_node_t *b, int depth, long *budget)
{
    if (a == b)
        return true;
    uint64_t ba = 0, bb = 0;
    double fa = 0, fb = 0;
    int ca = num_class(a, &ba, &fa), cb = num_class(b, &bb, &fb);
    if (ca || cb)
        return ca == cb && (ca == 3 ? fa == fb : ba == bb);
    if (a->kind != b->kind)
        return false;
    switch (a->kind) {
    case PV_NONE: return true;
    case PV_STR:
    case PV_BYTES:
    case PV_BIGINT:
        return a->v.s.len == b->v.s.len && memcmp(a->v.s.data, b->v.s.data, a->v.s.len) == 0;
    case PV_TUPLE:
        if (a->v.seq.len != b->v.seq.len || depth >= KEY_DEPTH_MAX ||
            (*budget -= 1 + (long)a->v.seq.len) < 0)
            return false;
        for (uint32_t i = 0; i < a->v.seq.len; i++)
            if (!key_equal_walk(a->v.seq.items[i], b->v.seq.items[i], depth + 1, budget))
                return false;
        return true;
    default: return false;
    }
}

static bool key_equal(const pv_node_t *a, const pv_node_t *b)
{
    long budget = KEY_BUDGET;
    return key_equal_walk(a, b, 0, &budget);
}

/* ---- dicts and lists --------------------------------------------------------------- */

static void dict_index_insert(pv_node_t *d, uint32_t pair, uint64_t hash)
{
    uint32_t mask = d->v.dict.cap * 2 - 1;
    uint32_t slot = (uint32_t)hash & mask;
    while (d->v.dict.index[slot])
        slot = (slot + 1) & mask;
    d->v.dict.index[slot] = pair + 1;
}

/* Make room for `extra` more pairs; false when out of memory or too many. */
bool pv_dict_reserve(pv_doc_t *doc, pv_node_t *d, size_t extra)
{
    size_t need = (size_t)d->v.dict.len + extra;
    if (need <= d->v.dict.cap)
        return true;
    if (need > SEQ_MAX / 4)
        return false;
    size_t cap = need;
    if (cap > DICT_INDEX_MIN) {
        size_t p = 16;
        while (p < cap || p < (size_t)d->v.dict.cap * 2)
            p *= 2;
        cap = p;
    }
    pv_node_t **kv = pv_arena_alloc(doc, cap * 2 * sizeof(pv_node_t *));
    if (!kv)
        return false;
    if (d->v.dict.len)
        memcpy(kv, d->v.dict.kv, (size_t)d->v.dict.len * 2 * sizeof(pv_node_t *));
    d->v.dict.kv = kv;
    d->v.dict.cap = (uint32_t)cap;
    d->v.dict.index = NULL;
    if (cap > DICT_INDEX_MIN) {
        uint32_t *index = pv_arena_alloc(doc, cap * 2 * sizeof(uint32_t));
        if (!index)
            return false;
        memset(index, 0, cap * 2 * sizeof(uint32_t));
        d->v.dict.index = index;
        for (uint32_t i = 0; i < d->v.dict.len; i++)
            dict_index_insert(d, i, key_hash(kv[2 * i]));
    }
    return true;
}

/* The pair index of key in d, or -1. */
static int64_t dict_find(const pv_node_t *d, const pv_node_t *key, uint64_t hash)
{
    if (!d->v.dict.index) {
        for (uint32_t i = 0; i < d->v.dict.len; i++)
            if (key_equal(d->v.dict.kv[2 * i], key))
                return i;
        return -1;
    }
    uint32_t mask = d->v.dict.cap * 2 - 1;
    for (uint32_t slot = (uint32_t)hash & mask; d->v.dict.index[slot]; slot = (slot + 1) & mask) {
        uint32_t pair = d->v.dict.index[slot] - 1;
        if (key_equal(d->v.dict.kv[2 * pair], key))
            return pair;
    }
    return -1;
}

/* d[key] = value with room already reserved; the key must be hashable. */
void pv_dict_put_reserved(pv_node_t *d, pv_node_t *key, pv_node_t *value)
{
    uint64_t hash = d->v.dict.index ? key_hash(key) : 0;
    int64_t at = dict_find(d, key, hash);
    if (at >= 0) {
        d->v.dict.kv[2 * at + 1] = value;
        return;
    }
    uint32_t pair = d->v.dict.len++;
    d->v.dict.kv[2 * pair] = key;
    d->v.dict.kv[2 * pair + 1] = value;
    if (d->v.dict.index)
        dict_index_insert(d, pair, hash);
}

bool pv_list_reserve(pv_doc_t *doc, pv_node_t *l, size_t extra)
{
    size_t need = (size_t)l->v.seq.len + extra;
    if (need <= l->v.seq.cap)
        return true;
    if (need > SEQ_MAX)
        return false;
    size_t cap = (size_t)l->v.seq.cap * 2;
    if (cap < need)
        cap = need;
    if (cap < 4)
        cap = 4;
    if (cap > SEQ_MAX)
        cap = SEQ_MAX;
    pv_node_t **items = pv_arena_alloc(doc, cap * sizeof(pv_node_t *));
    if (!items)
        return false;
    if (l->v.seq.len)
        memcpy(items, l->v.seq.items, (size_t)l->v.seq.len * sizeof(pv_node_t *));
    l->v.seq.items = items;
    l->v.seq.cap = (uint32_t)cap;
    return true;
}

/* ---- reading values ----------------------------------------------------------------- */

pv_kind_t pv_kind(const pv_node_t *node)
{
    return node ? (pv_kind_t)node->kind : PV_NONE;
}

const char *pv_kind_name(pv_kind_t kind)
{
    static const char *const names[] = {"none", "bool", "int", "bigint", "float",
                                        "str", "bytes", "list", "tuple", "dict"};
    return (unsigned)kind < sizeof(names) / sizeof(names[0]) ? names[kind] : "?";
}

size_t pv_len(const pv_node_t *node)
{
    if (!node)
        return 0;
    switch (node->kind) {
    case PV_STR: case PV_BYTES: case PV_BIGINT: return node->v.s.len;
    case PV_LIST: case PV_TUPLE: return node->v.seq.len;
    case PV_DICT: return node->v.dict.len;
    default: return 0;
    }
}

const pv_node_t *pv_at(const pv_node_t *node, size_t i)
{
    if (!node || (node->kind != PV_LIST && node->kind != PV_TUPLE) || i >= node->v.seq.len)
        return NULL;
    return node->v.seq.items[i];
}

const pv_node_t *pv_dict_key_at(const pv_node_t *node, size_t i)
{
    if (!node || node->kind != PV_DICT || i >= node->v.dict.len)
        return NULL;
    return node->v.dict.kv[2 * i];
}

const pv_node_t *pv_dict_value_at(const pv_node_t *node, size_t i)
{
    if (!node || node->kind != PV_DICT || i >= node->v.dict.len)
        return NULL;
    return node->v.dict.kv[2 * i + 1];
}

const pv_node_t *pv_dict_getn(const pv_node_t *node, const char *key, size_t key_len)
{
    if (!node || node->kind != PV_DICT || !key)
        return NULL;
    if (!node->v.dict.index) {
        for (uint32_t i = 0; i < node->v.dict.len; i++) {
            const pv_node_t *k = node->v.dict.kv[2 * i];
            if (k->kind == PV_STR && k->v.s.len == key_len && memcmp(k->v.s.data, key, key_len) == 0)
                return node->v.dict.kv[2 * i + 1];
        }
        return NULL;
    }
    pv_node_t probe;
    memset(&probe, 0, sizeof(probe));
    probe.kind = PV_STR;
    probe.v.s.data = key;
    probe.v.s.len = key_len;
    int64_t at = dict_find(node, &probe, pv_hash_mem(key, key_len));
    return at >= 0 ? node->v.dict.kv[2 * at + 1] : NULL;
}

const pv_node_t *pv_dict_get(const pv_node_t *node, const char *key)
{
    return key ? pv_dict_getn(node, key, strlen(key)) : NULL;
}

bool pv_is_none(const pv_node_t *node)
{
    return node && node->kind == PV_NONE;
}

bool pv_get_bool(const pv_node_t *node, bool *out)
{
    if (!node || node->kind != PV_BOOL)
        return false;
    *out = node->v.b;
    return true;
}

bool pv_get_int(const pv_node_t *node, int64_t *out)
{
    if (!node || node->kind != PV_INT || (node->flags & PVF_U64))
        return false;
    *out = node->v.i;
    return true;
}

bool pv_get_u64(const pv_node_t *node, uint64_t *out)
{
    if (!node || node->kind != PV_INT || (!(node->flags & PVF_U64) && node->v.i < 0))
        return false;
    *out = node->v.u;
    return true;
}

bool pv_is_u64(const pv_node_t *node)
{
    return node && node->kind == PV_INT && (node->flags & PVF_U64);
}

bool pv_get_double(const pv_node_t *node, double *out)
{
    if (!node)
        return false;
    if (node->kind == PV_FLOAT)
        *out = node->v.f;
    else if (node->kind == PV_INT)
        *out = (node->flags & PVF_U64) ? (double)node->v.u : (double)node->v.i;
    else
        return false;
    return true;
}

bool pv_get_str(const pv_node_t *node, const char **s, size_t *len)
{
    if (!node || node->kind != PV_STR)
        return false;
    *s = node->v.s.data;
    if (len)
        *len = node->v.s.len;
    return true;
}

bool pv_get_bytes(const pv_node_t *node, const uint8_t **data, size_t *len)
{
    if (!node || node->kind != PV_BYTES)
        return false;
    *data = (const uint8_t *)node->v.s.data;
    *len = node->v.s.len;
    return true;
}

bool pv_get_bigint(const pv_node_t *node, const uint8_t **data, size_t *len)
{
    if (!node || node->kind != PV_BIGINT)
        return false;
    *data = (const uint8_t *)node->v.s.data;
    *len = node->v.s.len;
    return true;
}

bool pv_str_eq(const pv_node_t *node, const char *s)
{
    if (!node || node->kind != PV_STR || !s)
        return false;
    size_t n = strlen(s);
    return n == node->v.s.len && memcmp(node->v.s.data, s, n) == 0;
}

/* ---- UTF-8 and integers ---------------------------------------------------------------- */

/* Valid UTF-8 as Python's "surrogatepass" decoder accepts it. */
bool pv_utf8_valid(const unsigned char *p, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned c = p[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t extra;
        unsigned lo = 0x80, hi = 0xbf;
        if (c >= 0xc2 && c <= 0xdf) {
            extra = 1;
        } else if (c >= 0xe0 && c <= 0xef) {
            extra = 2;
            if (c == 0xe0)
                lo = 0xa0;
        } else if (c >= 0xf0 && c <= 0xf4) {
            extra = 3;
            if (c == 0xf0)
                lo = 0x90;
            if (c == 0xf4)
                hi = 0x8f;
        } else {
            return false;
        }
        if (n - i <= extra)
            return false;
        if (p[i + 1] < lo || p[i + 1] > hi)
            return false;
        for (size_t k = 2; k <= extra; k++)
            if ((p[i + k] & 0xc0) != 0x80)
                return false;
        i += extra + 1;
    }
    return true;
}

/* Strip redundant sign bytes from a little-endian two's complement integer. */
size_t pv_bigint_minimal_len(const uint8_t *b, size_t n)
{
    while (n > 1 && ((b[n - 1] == 0x00 && !(b[n - 2] & 0x80)) ||
                     (b[n - 1] == 0xff && (b[n - 2] & 0x80))))
        n--;
    return n;
}

/* An integer node from little-endian two's complement bytes. */
pv_node_t *pv_node_from_le(pv_doc_t *doc, const uint8_t *b, size_t n)
{
    n = pv_bigint_minimal_len(b, n);
    if (n <= 8) {
        uint64_t u = 0;
        for (size_t i = 0; i < n; i++)
            u |= (uint64_t)b[i] << (8 * i);
        if (n && n < 8 && (b[n - 1] & 0x80))
            u |= ~(uint64_t)0 << (8 * n);
        pv_node_t *node = pv_node_alloc(doc, PV_INT);
        if (node)
            node->v.u = u;
        return node;
    }
    if (n == 9 && b[8] == 0) {
        uint64_t u = 0;
        for (size_t i = 0; i < 8; i++)
            u |= (uint64_t)b[i] << (8 * i);
        pv_node_t *node = pv_node_alloc(doc, PV_INT);
        if (node) {
            node->v.u = u;
            node->flags = PVF_U64;
        }
        return node;
    }
    return pv_node_bytes(doc, PV_BIGINT, b, n);
}

/* ---- builders -------------------------------------------------------------------------- */

static pv_node_t *build_failed(pv_doc_t *doc, cca_status_t status)
{
    if (doc->failed == CCA_OK)
        doc->failed = status;
    return NULL;
}

static pv_node_t *build_oom(pv_doc_t *doc)
{
    cca_raise(CCA_ERR_OUT_OF_MEMORY, "pickle: out of memory building a value");
    return build_failed(doc, CCA_ERR_OUT_OF_MEMORY);
}

static pv_node_t *build_scalar(pv_doc_t *doc, pv_kind_t kind)
{
    pv_node_t *n = pv_node_alloc(doc, kind);
    return n ? n : build_oom(doc);
}

pv_node_t *pv_new_none(pv_doc_t *doc)
{
    return build_scalar(doc, PV_NONE);
}

pv_node_t *pv_new_bool(pv_doc_t *doc, bool value)
{
    pv_node_t *n = build_scalar(doc, PV_BOOL);
    if (n)
        n->v.b = value;
    return n;
}

pv_node_t *pv_new_int(pv_doc_t *doc, int64_t value)
{
    pv_node_t *n = build_scalar(doc, PV_INT);
    if (n)
        n->v.i = value;
    return n;
}

pv_node_t *pv_new_u64(pv_doc_t *doc, uint64_t value)
{
    pv_node_t *n = build_scalar(doc, PV_INT);
    if (n) {
        n->v.u = value;
        if (value > (uint64_t)INT64_MAX)
            n->flags = PVF_U64;
    }
    return n;
}

pv_node_t *pv_new_bigint(pv_doc_t *doc, const uint8_t *data, size_t len)
{
    pv_node_t *n = pv_node_from_le(doc, data, len);
    return n ? n : build_oom(doc);
}

pv_node_t *pv_new_float(pv_doc_t *doc, double value)
{
    pv_node_t *n = build_scalar(doc, PV_FLOAT);
    if (n)
        n->v.f = value;
    return n;
}

pv_node_t *pv_new_strn(pv_doc_t *doc, const char *s, size_t len)
{
    if (!s || !pv_utf8_valid((const unsigned char *)s, len)) {
        cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle: string is NULL or not valid UTF-8");
        return build_failed(doc, CCA_ERR_INVALID_ARGUMENT);
    }
    pv_node_t *n = pv_node_bytes(doc, PV_STR, s, len);
    return n ? n : build_oom(doc);
}

pv_node_t *pv_new_str(pv_doc_t *doc, const char *s)
{
    return pv_new_strn(doc, s, s ? strlen(s) : 0);
}

pv_node_t *pv_new_text(pv_doc_t *doc, const char *s, size_t len)
{
    if (!s)
        s = "", len = 0;
    const unsigned char *p = (const unsigned char *)s;
    if (pv_utf8_valid(p, len))
        return pv_new_strn(doc, s, len);
    unsigned char *out = malloc(len * 3 + 1); /* each bad byte: U+FFFD's three */
    if (!out) {
        cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory building a pickle");
        return build_oom(doc);
    }
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        size_t k = 1;
        while (k <= 4 && !(i + k <= len && pv_utf8_valid(p + i, k)))
            k++;
        if (k <= 4) { /* a whole character */
            memcpy(out + n, p + i, k);
            n += k;
            i += k;
        } else {
            memcpy(out + n, "\xef\xbf\xbd", 3);
            n += 3;
            i++;
        }
    }
    pv_node_t *node = pv_new_strn(doc, (const char *)out, n);
    free(out);
    return node;
}

pv_node_t *pv_new_bytes(pv_doc_t *doc, const void *data, size_t len)
{
    pv_node_t *n = pv_node_bytes(doc, PV_BYTES, data, len);
    return n ? n : build_oom(doc);
}

pv_node_t *pv_new_list(pv_doc_t *doc)
{
    return build_scalar(doc, PV_LIST);
}

pv_node_t *pv_new_dict(pv_doc_t *doc)
{
    return build_scalar(doc, PV_DICT);
}

pv_node_t *pv_new_tuple(pv_doc_t *doc, size_t n, pv_node_t *const *items)
{
    for (size_t i = 0; i < n; i++)
        if (!items[i])
            return build_failed(doc, doc->failed ? doc->failed : CCA_ERR_INVALID_ARGUMENT);
    if (n > SEQ_MAX)
        return build_oom(doc);
    pv_node_t *t = build_scalar(doc, PV_TUPLE);
    if (!t || !n)
        return t;
    pv_node_t **copy = pv_arena_alloc(doc, n * sizeof(pv_node_t *));
    if (!copy)
        return build_oom(doc);
    memcpy(copy, items, n * sizeof(pv_node_t *));
    t->v.seq.items = copy;
    t->v.seq.len = t->v.seq.cap = (uint32_t)n;
    return t;
}

/* Status for a NULL value handed to a setter. */
static cca_status_t null_value_status(pv_doc_t *doc, const char *what)
{
    if (doc->failed != CCA_OK)
        return doc->failed;
    return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle: %s: NULL value or container", what);
}

/* The document's shared str node for a key text (interned, so keys are one node each). */
static pv_node_t *intern_key(pv_doc_t *doc, const char *key, size_t len)
{
    uint64_t h = pv_hash_mem(key, len);
    if (doc->interned_len * 2 >= doc->interned_cap) {
        size_t cap = doc->interned_cap ? doc->interned_cap * 2 : 64;
        pv_node_t **table = calloc(cap, sizeof(*table));
        if (!table)
            return NULL;
        for (size_t i = 0; i < doc->interned_cap; i++) {
            pv_node_t *k = doc->interned[i];
            if (!k)
                continue;
            size_t slot = pv_hash_mem(k->v.s.data, k->v.s.len) & (cap - 1);
            while (table[slot])
                slot = (slot + 1) & (cap - 1);
            table[slot] = k;
        }
        free(doc->interned);
        doc->interned = table;
        doc->interned_cap = cap;
    }
    size_t slot = h & (doc->interned_cap - 1);
    for (; doc->interned[slot]; slot = (slot + 1) & (doc->interned_cap - 1)) {
        pv_node_t *k = doc->interned[slot];
        if (k->v.s.len == len && memcmp(k->v.s.data, key, len) == 0)
            return k;
    }
    pv_node_t *k = pv_node_bytes(doc, PV_STR, key, len);
    if (!k)
        return NULL;
    doc->interned[slot] = k;
    doc->interned_len++;
    return k;
}

cca_status_t pv_dict_set_node(pv_doc_t *doc, pv_node_t *dict, pv_node_t *key, pv_node_t *value)
{
    if (!doc)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle: pv_dict_set: NULL document");
    if (!dict || !key || !value)
        return null_value_status(doc, "pv_dict_set");
    if (dict->kind != PV_DICT)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle: pv_dict_set on a %s, not a dict",
                         pv_kind_name(dict->kind));
    if (!pv_key_ok(key))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle: unhashable dict key (%s)",
                         pv_kind_name(key->kind));
    if (!pv_dict_reserve(doc, dict, 1)) {
        build_oom(doc);
        return CCA_ERR_OUT_OF_MEMORY;
    }
    pv_dict_put_reserved(dict, key, value);
    return CCA_OK;
}

cca_status_t pv_dict_set(pv_doc_t *doc, pv_node_t *dict, const char *key, pv_node_t *value)
{
    if (!doc)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle: pv_dict_set: NULL document");
    if (!dict || !value)
        return null_value_status(doc, "pv_dict_set");
    size_t len = key ? strlen(key) : 0;
    if (!key || !pv_utf8_valid((const unsigned char *)key, len))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle: dict key is NULL or not valid UTF-8");
    pv_node_t *k = intern_key(doc, key, len);
    if (!k) {
        build_oom(doc);
        return CCA_ERR_OUT_OF_MEMORY;
    }
    return pv_dict_set_node(doc, dict, k, value);
}

cca_status_t pv_list_append(pv_doc_t *doc, pv_node_t *list, pv_node_t *value)
{
    if (!doc)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle: pv_list_append: NULL document");
    if (!list || !value)
        return null_value_status(doc, "pv_list_append");
    if (list->kind != PV_LIST)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle: pv_list_append on a %s, not a list",
                         pv_kind_name(list->kind));
    if (!pv_list_reserve(doc, list, 1)) {
        build_oom(doc);
        return CCA_ERR_OUT_OF_MEMORY;
    }
    list->v.seq.items[list->v.seq.len++] = value;
    return CCA_OK;
}
