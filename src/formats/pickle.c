/*
 * pickle.c - Python pickle values (pv_*): the arena-backed value tree, the
 * reader (protocols 0-5, plain data opcodes only) and the protocol-4 writer
 * used for PyTorch memory snapshots.
 *
 * Invariants: every node, string and item array of a document lives in its
 * arena and dies with it; the reader never allocates more than a constant
 * times the input size (a length field is checked against the bytes left
 * before anything is allocated, memo indices are bounded by the input size)
 * and never recurses; a dict holds each key at most once (Python's equality),
 * and a dict with more than DICT_INDEX_MIN slots carries a hash index of its
 * keys, rebuilt whenever its pair array grows.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>

#include "pickle.h"

/* ---- nodes and the arena -------------------------------------------------------- */

#define PVF_U64 0x01          /* PV_INT holds a uint64 >= 2^63 */
#define DICT_INDEX_MIN 8      /* dicts with a larger capacity get a hash index */
#define KEY_DEPTH_MAX 64      /* tuple keys nested deeper are refused */
#define SEQ_MAX UINT32_MAX    /* items per list/tuple/dict */

struct pv_node {
    uint8_t kind;  /* pv_kind_t */
    uint8_t flags; /* PVF_* */
    union {
        bool b;
        int64_t i;
        uint64_t u;
        double f;
        struct {
            const char *data; /* NUL-terminated copy in the arena */
            size_t len;       /* bytes, without the NUL */
        } s;                  /* PV_STR, PV_BYTES, PV_BIGINT */
        struct {
            pv_node_t **items;
            uint32_t len, cap;
        } seq;                /* PV_LIST, PV_TUPLE */
        struct {
            pv_node_t **kv;   /* key, value, key, value ... */
            uint32_t len, cap; /* pairs; cap is a power of two once > DICT_INDEX_MIN */
            uint32_t *index;  /* 2 * cap slots of (pair + 1), 0 = empty; NULL while small */
        } dict;
    } v;
};

typedef struct arena_chunk {
    struct arena_chunk *next;
    size_t size; /* usable bytes after the header */
} arena_chunk_t;

#define ARENA_FIRST_CHUNK ((size_t)64 * 1024)
#define ARENA_MAX_CHUNK ((size_t)8 * 1024 * 1024)
#define ARENA_ALIGN 8

struct pv_doc {
    arena_chunk_t *chunks;   /* newest first */
    char *cur, *end;         /* bump range in the current chunk */
    size_t next_chunk;       /* size of the next ordinary chunk */
    size_t arena_bytes;      /* total chunk bytes */
    pv_node_t *root;
    cca_status_t failed;     /* first builder failure, CCA_OK if none */
    pv_node_t **interned;    /* open addressing table of str keys (malloc'd) */
    size_t interned_len, interned_cap;
};

static void *arena_alloc(pv_doc_t *doc, size_t size)
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

static pv_node_t *node_alloc(pv_doc_t *doc, pv_kind_t kind)
{
    pv_node_t *n = arena_alloc(doc, sizeof(pv_node_t));
    if (!n)
        return NULL;
    memset(n, 0, sizeof(*n));
    n->kind = (uint8_t)kind;
    return n;
}

/* A node holding a NUL-terminated arena copy of data. */
static pv_node_t *node_bytes(pv_doc_t *doc, pv_kind_t kind, const void *data, size_t len)
{
    if (len >= SIZE_MAX - 16)
        return NULL;
    pv_node_t *n = node_alloc(doc, kind);
    char *copy = n ? arena_alloc(doc, len + 1) : NULL;
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

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static uint64_t hash_mem(const void *data, size_t len)
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

static bool key_ok(const pv_node_t *n)
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
        return mix64(bits + (uint64_t)cls);
    switch (n->kind) {
    case PV_STR: return hash_mem(n->v.s.data, n->v.s.len);
    case PV_BYTES: return hash_mem(n->v.s.data, n->v.s.len) ^ 0x5bd1e995u;
    case PV_BIGINT: return hash_mem(n->v.s.data, n->v.s.len) ^ 0x27d4eb2fu;
    case PV_TUPLE: {
        uint64_t h = mix64(0x7475706cu + n->v.seq.len);
        if (depth < KEY_DEPTH_MAX && (*budget -= 1 + (long)n->v.seq.len) >= 0)
            for (uint32_t i = 0; i < n->v.seq.len; i++)
                h = mix64(h ^ key_hash_walk(n->v.seq.items[i], depth + 1, budget));
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
static bool dict_reserve(pv_doc_t *doc, pv_node_t *d, size_t extra)
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
    pv_node_t **kv = arena_alloc(doc, cap * 2 * sizeof(pv_node_t *));
    if (!kv)
        return false;
    if (d->v.dict.len)
        memcpy(kv, d->v.dict.kv, (size_t)d->v.dict.len * 2 * sizeof(pv_node_t *));
    d->v.dict.kv = kv;
    d->v.dict.cap = (uint32_t)cap;
    d->v.dict.index = NULL;
    if (cap > DICT_INDEX_MIN) {
        uint32_t *index = arena_alloc(doc, cap * 2 * sizeof(uint32_t));
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
static void dict_put_reserved(pv_node_t *d, pv_node_t *key, pv_node_t *value)
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

static bool list_reserve(pv_doc_t *doc, pv_node_t *l, size_t extra)
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
    pv_node_t **items = arena_alloc(doc, cap * sizeof(pv_node_t *));
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
    int64_t at = dict_find(node, &probe, hash_mem(key, key_len));
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
static bool utf8_valid(const unsigned char *p, size_t n)
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
static size_t bigint_minimal_len(const uint8_t *b, size_t n)
{
    while (n > 1 && ((b[n - 1] == 0x00 && !(b[n - 2] & 0x80)) ||
                     (b[n - 1] == 0xff && (b[n - 2] & 0x80))))
        n--;
    return n;
}

/* An integer node from little-endian two's complement bytes. */
static pv_node_t *node_from_le(pv_doc_t *doc, const uint8_t *b, size_t n)
{
    n = bigint_minimal_len(b, n);
    if (n <= 8) {
        uint64_t u = 0;
        for (size_t i = 0; i < n; i++)
            u |= (uint64_t)b[i] << (8 * i);
        if (n && n < 8 && (b[n - 1] & 0x80))
            u |= ~(uint64_t)0 << (8 * n);
        pv_node_t *node = node_alloc(doc, PV_INT);
        if (node)
            node->v.u = u;
        return node;
    }
    if (n == 9 && b[8] == 0) {
        uint64_t u = 0;
        for (size_t i = 0; i < 8; i++)
            u |= (uint64_t)b[i] << (8 * i);
        pv_node_t *node = node_alloc(doc, PV_INT);
        if (node) {
            node->v.u = u;
            node->flags = PVF_U64;
        }
        return node;
    }
    return node_bytes(doc, PV_BIGINT, b, n);
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
    pv_node_t *n = node_alloc(doc, kind);
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
    pv_node_t *n = node_from_le(doc, data, len);
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
    if (!s || !utf8_valid((const unsigned char *)s, len)) {
        cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle: string is NULL or not valid UTF-8");
        return build_failed(doc, CCA_ERR_INVALID_ARGUMENT);
    }
    pv_node_t *n = node_bytes(doc, PV_STR, s, len);
    return n ? n : build_oom(doc);
}

pv_node_t *pv_new_str(pv_doc_t *doc, const char *s)
{
    return pv_new_strn(doc, s, s ? strlen(s) : 0);
}

pv_node_t *pv_new_bytes(pv_doc_t *doc, const void *data, size_t len)
{
    pv_node_t *n = node_bytes(doc, PV_BYTES, data, len);
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
    pv_node_t **copy = arena_alloc(doc, n * sizeof(pv_node_t *));
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
    uint64_t h = hash_mem(key, len);
    if (doc->interned_len * 2 >= doc->interned_cap) {
        size_t cap = doc->interned_cap ? doc->interned_cap * 2 : 64;
        pv_node_t **table = calloc(cap, sizeof(*table));
        if (!table)
            return NULL;
        for (size_t i = 0; i < doc->interned_cap; i++) {
            pv_node_t *k = doc->interned[i];
            if (!k)
                continue;
            size_t slot = hash_mem(k->v.s.data, k->v.s.len) & (cap - 1);
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
    pv_node_t *k = node_bytes(doc, PV_STR, key, len);
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
    if (!key_ok(key))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle: unhashable dict key (%s)",
                         pv_kind_name(key->kind));
    if (!dict_reserve(doc, dict, 1)) {
        build_oom(doc);
        return CCA_ERR_OUT_OF_MEMORY;
    }
    dict_put_reserved(dict, key, value);
    return CCA_OK;
}

cca_status_t pv_dict_set(pv_doc_t *doc, pv_node_t *dict, const char *key, pv_node_t *value)
{
    if (!doc)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle: pv_dict_set: NULL document");
    if (!dict || !value)
        return null_value_status(doc, "pv_dict_set");
    size_t len = key ? strlen(key) : 0;
    if (!key || !utf8_valid((const unsigned char *)key, len))
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
    if (!list_reserve(doc, list, 1)) {
        build_oom(doc);
        return CCA_ERR_OUT_OF_MEMORY;
    }
    list->v.seq.items[list->v.seq.len++] = value;
    return CCA_OK;
}

/* ---- reader ------------------------------------------------------------------------------ */

enum {
    OP_MARK = '(', OP_STOP = '.', OP_POP = '0', OP_POP_MARK = '1', OP_DUP = '2',
    OP_BINFLOAT = 'G', OP_INT = 'I', OP_BININT = 'J', OP_BININT1 = 'K', OP_LONG = 'L',
    OP_BININT2 = 'M', OP_NONE = 'N', OP_BINUNICODE = 'X', OP_APPEND = 'a', OP_BINBYTES = 'B',
    OP_SHORT_BINBYTES = 'C', OP_DICT = 'd', OP_EMPTY_DICT = '}', OP_APPENDS = 'e',
    OP_BINGET = 'h', OP_LONG_BINGET = 'j', OP_LIST = 'l', OP_EMPTY_LIST = ']',
    OP_BINPUT = 'q', OP_LONG_BINPUT = 'r', OP_SETITEM = 's', OP_TUPLE = 't',
    OP_EMPTY_TUPLE = ')', OP_SETITEMS = 'u', OP_PROTO = 0x80, OP_TUPLE1 = 0x85,
    OP_TUPLE2 = 0x86, OP_TUPLE3 = 0x87, OP_NEWTRUE = 0x88, OP_NEWFALSE = 0x89,
    OP_LONG1 = 0x8a, OP_LONG4 = 0x8b, OP_SHORT_BINUNICODE = 0x8c, OP_BINUNICODE8 = 0x8d,
    OP_BINBYTES8 = 0x8e, OP_MEMOIZE = 0x94, OP_FRAME = 0x95, OP_BYTEARRAY8 = 0x96,
};

static const char *op_name(int op)
{
    switch (op) {
    case OP_MARK: return "MARK";
    case OP_STOP: return "STOP";
    case OP_POP: return "POP";
    case OP_POP_MARK: return "POP_MARK";
    case OP_DUP: return "DUP";
    case OP_BINFLOAT: return "BINFLOAT";
    case OP_INT: return "INT";
    case OP_BININT: return "BININT";
    case OP_BININT1: return "BININT1";
    case OP_LONG: return "LONG";
    case OP_BININT2: return "BININT2";
    case OP_NONE: return "NONE";
    case OP_BINUNICODE: return "BINUNICODE";
    case OP_APPEND: return "APPEND";
    case OP_BINBYTES: return "BINBYTES";
    case OP_SHORT_BINBYTES: return "SHORT_BINBYTES";
    case OP_DICT: return "DICT";
    case OP_EMPTY_DICT: return "EMPTY_DICT";
    case OP_APPENDS: return "APPENDS";
    case OP_BINGET: return "BINGET";
    case OP_LONG_BINGET: return "LONG_BINGET";
    case OP_LIST: return "LIST";
    case OP_EMPTY_LIST: return "EMPTY_LIST";
    case OP_BINPUT: return "BINPUT";
    case OP_LONG_BINPUT: return "LONG_BINPUT";
    case OP_SETITEM: return "SETITEM";
    case OP_TUPLE: return "TUPLE";
    case OP_EMPTY_TUPLE: return "EMPTY_TUPLE";
    case OP_SETITEMS: return "SETITEMS";
    case OP_PROTO: return "PROTO";
    case OP_TUPLE1: return "TUPLE1";
    case OP_TUPLE2: return "TUPLE2";
    case OP_TUPLE3: return "TUPLE3";
    case OP_NEWTRUE: return "NEWTRUE";
    case OP_NEWFALSE: return "NEWFALSE";
    case OP_LONG1: return "LONG1";
    case OP_LONG4: return "LONG4";
    case OP_SHORT_BINUNICODE: return "SHORT_BINUNICODE";
    case OP_BINUNICODE8: return "BINUNICODE8";
    case OP_BINBYTES8: return "BINBYTES8";
    case OP_MEMOIZE: return "MEMOIZE";
    case OP_FRAME: return "FRAME";
    case OP_BYTEARRAY8: return "BYTEARRAY8";
    default: return "?";
    }
}

typedef struct reader {
    pv_doc_t *doc;
    const uint8_t *data;
    size_t size, pos;
    pv_node_t **stack;
    size_t sp, stack_cap;
    size_t *marks;
    size_t nmarks, marks_cap;
    pv_node_t **memo;       /* index -> node, NULL = unset */
    size_t memo_cap;        /* slots allocated */
    size_t memo_count;      /* slots set (MEMOIZE's next index, as Python's len(memo)) */
    pv_node_t *small_ints[256]; /* shared BININT1 nodes */
    pv_node_t *none, *yes, *no;
} reader_t;

static cca_status_t rd_error(reader_t *r, size_t off, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static cca_status_t rd_error(reader_t *r, size_t off, const char *fmt, ...)
{
    char text[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    (void)r;
    return cca_raise(CCA_ERR_FORMAT, "pickle: %s at offset %zu", text, off);
}

static cca_status_t rd_oom(void)
{
    return cca_raise(CCA_ERR_OUT_OF_MEMORY, "pickle: out of memory while loading");
}

static uint64_t get_le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static cca_status_t rd_need(reader_t *r, size_t op_off, int op, size_t n)
{
    if (r->size - r->pos >= n)
        return CCA_OK;
    return rd_error(r, op_off, "truncated %s: needs %zu argument bytes, %zu left", op_name(op), n,
                    r->size - r->pos);
}

static cca_status_t rd_push(reader_t *r, pv_node_t *n)
{
    if (!n)
        return rd_oom();
    if (r->sp == r->stack_cap) {
        size_t cap = r->stack_cap ? r->stack_cap * 2 : 256;
        pv_node_t **s = realloc(r->stack, cap * sizeof(*s));
        if (!s)
            return rd_oom();
        r->stack = s;
        r->stack_cap = cap;
    }
    r->stack[r->sp++] = n;
    return CCA_OK;
}

static size_t rd_fence(const reader_t *r)
{
    return r->nmarks ? r->marks[r->nmarks - 1] : 0;
}

/* Check that `count` items sit above the current mark. */
static cca_status_t rd_have(reader_t *r, size_t op_off, int op, size_t count)
{
    if (r->sp - rd_fence(r) >= count)
        return CCA_OK;
    return rd_error(r, op_off, "stack underflow in %s (needs %zu items)", op_name(op), count);
}

/* Pop the top mark; *mark is the stack depth it recorded. */
static cca_status_t rd_pop_mark(reader_t *r, size_t op_off, int op, size_t *mark)
{
    if (!r->nmarks)
        return rd_error(r, op_off, "%s without a MARK", op_name(op));
    *mark = r->marks[--r->nmarks];
    return CCA_OK;
}

static cca_status_t rd_memo_put(reader_t *r, size_t op_off, uint64_t idx)
{
    if (r->sp <= rd_fence(r))
        return rd_error(r, op_off, "memo store with an empty stack");
    /* A writer numbers memo slots from 0; an index beyond the input size is bogus. */
    if (idx >= r->size)
        return rd_error(r, op_off, "memo index %llu out of range", (unsigned long long)idx);
    if (idx >= r->memo_cap) {
        size_t cap = r->memo_cap ? r->memo_cap * 2 : 1024;
        while (cap <= idx)
            cap *= 2;
        pv_node_t **memo = realloc(r->memo, cap * sizeof(*memo));
        if (!memo)
            return rd_oom();
        memset(memo + r->memo_cap, 0, (cap - r->memo_cap) * sizeof(*memo));
        r->memo = memo;
        r->memo_cap = cap;
    }
    if (!r->memo[idx])
        r->memo_count++;
    r->memo[idx] = r->stack[r->sp - 1];
    return CCA_OK;
}

static cca_status_t rd_memo_get(reader_t *r, size_t op_off, uint64_t idx)
{
    if (idx >= r->memo_cap || !r->memo[idx])
        return rd_error(r, op_off, "memo key %llu is not defined", (unsigned long long)idx);
    return rd_push(r, r->memo[idx]);
}

/* A node holding a string or bytes argument of n bytes at the read position. */
static cca_status_t rd_blob(reader_t *r, size_t op_off, int op, uint64_t n, pv_kind_t kind)
{
    if (n > r->size - r->pos)
        return rd_error(r, op_off, "truncated %s: length %llu exceeds the %zu bytes left",
                        op_name(op), (unsigned long long)n, r->size - r->pos);
    const uint8_t *p = r->data + r->pos;
    if (kind == PV_STR && !utf8_valid(p, (size_t)n))
        return rd_error(r, op_off, "%s is not valid UTF-8", op_name(op));
    r->pos += (size_t)n;
    return rd_push(r, node_bytes(r->doc, kind, p, (size_t)n));
}

/* A text line argument (INT, LONG): [start, *end) up to the newline. */
static cca_status_t rd_line(reader_t *r, size_t op_off, int op, const char **start, size_t *len)
{
    const uint8_t *p = r->data + r->pos;
    const uint8_t *nl = memchr(p, '\n', r->size - r->pos);
    if (!nl)
        return rd_error(r, op_off, "truncated %s: no newline", op_name(op));
    *start = (const char *)p;
    *len = (size_t)(nl - p);
    r->pos += *len + 1;
    return CCA_OK;
}

/* Text INT/LONG: a decimal that fits in int64 or uint64 ("I01"/"I00" are True/False). */
static cca_status_t rd_text_int(reader_t *r, size_t op_off, int op)
{
    const char *s = NULL;
    size_t len = 0;
    cca_status_t st = rd_line(r, op_off, op, &s, &len);
    if (st)
        return st;
    if (op == OP_INT && len == 2 && s[0] == '0' && (s[1] == '0' || s[1] == '1'))
        return rd_push(r, s[1] == '1' ? r->yes : r->no);
    if (op == OP_LONG && len && s[len - 1] == 'L')
        len--;
    size_t i = 0;
    bool neg = false;
    if (i < len && (s[i] == '-' || s[i] == '+'))
        neg = s[i++] == '-';
    if (i == len)
        return rd_error(r, op_off, "%s: no digits", op_name(op));
    uint64_t mag = 0;
    for (; i < len; i++) {
        if (s[i] < '0' || s[i] > '9')
            return rd_error(r, op_off, "%s: bad digit '%c'", op_name(op), s[i]);
        unsigned d = (unsigned)(s[i] - '0');
        if (mag > (UINT64_MAX - d) / 10)
            return rd_error(r, op_off, "%s: integer beyond 64 bits is not supported", op_name(op));
        mag = mag * 10 + d;
    }
    if (neg && mag > (uint64_t)INT64_MAX + 1)
        return rd_error(r, op_off, "%s: integer beyond 64 bits is not supported", op_name(op));
    pv_node_t *n = node_alloc(r->doc, PV_INT);
    if (n) {
        n->v.u = neg ? (uint64_t)0 - mag : mag;
        if (!neg && mag > (uint64_t)INT64_MAX)
            n->flags = PVF_U64;
    }
    return rd_push(r, n);
}

/* A new list or tuple holding the stack items above `mark`. */
static pv_node_t *rd_seq_from_stack(reader_t *r, pv_kind_t kind, size_t mark)
{
    size_t n = r->sp - mark;
    if (n > SEQ_MAX)
        return NULL;
    pv_node_t *s = node_alloc(r->doc, kind);
    if (!s || !n)
        return s;
    pv_node_t **items = arena_alloc(r->doc, n * sizeof(pv_node_t *));
    if (!items)
        return NULL;
    memcpy(items, r->stack + mark, n * sizeof(pv_node_t *));
    s->v.seq.items = items;
    s->v.seq.len = s->v.seq.cap = (uint32_t)n;
    r->sp = mark;
    return s;
}

/* dict[k] = v for the stack pairs above `from`, which are then popped. */
static cca_status_t rd_set_pairs(reader_t *r, size_t op_off, int op, pv_node_t *dict, size_t from)
{
    if (dict->kind != PV_DICT)
        return rd_error(r, op_off, "%s on a %s, not a dict", op_name(op), pv_kind_name(dict->kind));
    if ((r->sp - from) % 2)
        return rd_error(r, op_off, "odd number of items for %s", op_name(op));
    for (size_t i = from; i < r->sp; i += 2)
        if (!key_ok(r->stack[i]))
            return rd_error(r, op_off, "unhashable dict key (%s) in %s",
                            pv_kind_name(r->stack[i]->kind), op_name(op));
    if (!dict_reserve(r->doc, dict, (r->sp - from) / 2))
        return rd_oom();
    for (size_t i = from; i < r->sp; i += 2)
        dict_put_reserved(dict, r->stack[i], r->stack[i + 1]);
    r->sp = from;
    return CCA_OK;
}

static cca_status_t rd_append(reader_t *r, size_t op_off, int op, pv_node_t *list, size_t from)
{
    if (list->kind != PV_LIST)
        return rd_error(r, op_off, "%s on a %s, not a list", op_name(op), pv_kind_name(list->kind));
    if (r->sp == from)
        return CCA_OK; /* an empty APPENDS */
    if (!list_reserve(r->doc, list, r->sp - from))
        return rd_oom();
    memcpy(list->v.seq.items + list->v.seq.len, r->stack + from, (r->sp - from) * sizeof(pv_node_t *));
    list->v.seq.len += (uint32_t)(r->sp - from);
    r->sp = from;
    return CCA_OK;
}

static cca_status_t rd_run(reader_t *r)
{
    cca_status_t st = CCA_OK;
    for (;;) {
        if (r->pos >= r->size)
            return rd_error(r, r->pos, "pickle ends without STOP");
        size_t op_off = r->pos;
        int op = r->data[r->pos++];
        const uint8_t *arg = r->data + r->pos;
        size_t mark = 0;
        switch (op) {
        case OP_PROTO:
            if ((st = rd_need(r, op_off, op, 1)))
                return st;
            if (arg[0] > 5)
                return rd_error(r, op_off, "unsupported pickle protocol %d", arg[0]);
            r->pos += 1;
            break;
        case OP_FRAME: {
            if ((st = rd_need(r, op_off, op, 8)))
                return st;
            uint64_t len = get_le(arg, 8);
            r->pos += 8;
            if (len > r->size - r->pos)
                return rd_error(r, op_off, "frame of %llu bytes exceeds the %zu bytes left",
                                (unsigned long long)len, r->size - r->pos);
            break;
        }
        case OP_STOP:
            if ((st = rd_have(r, op_off, op, 1)))
                return st;
            r->doc->root = r->stack[--r->sp];
            return CCA_OK;
        case OP_MARK:
            if (r->nmarks == r->marks_cap) {
                size_t cap = r->marks_cap ? r->marks_cap * 2 : 64;
                size_t *m = realloc(r->marks, cap * sizeof(*m));
                if (!m)
                    return rd_oom();
                r->marks = m;
                r->marks_cap = cap;
            }
            r->marks[r->nmarks++] = r->sp;
            break;
        case OP_POP:
            if (r->nmarks && r->marks[r->nmarks - 1] == r->sp)
                r->nmarks--; /* as Python: POP right after MARK drops the mark */
            else if ((st = rd_have(r, op_off, op, 1)))
                return st;
            else
                r->sp--;
            break;
        case OP_POP_MARK:
            if ((st = rd_pop_mark(r, op_off, op, &mark)))
                return st;
            r->sp = mark;
            break;
        case OP_DUP:
            if ((st = rd_have(r, op_off, op, 1)) || (st = rd_push(r, r->stack[r->sp - 1])))
                return st;
            break;
        case OP_NONE:
            if ((st = rd_push(r, r->none)))
                return st;
            break;
        case OP_NEWTRUE:
        case OP_NEWFALSE:
            if ((st = rd_push(r, op == OP_NEWTRUE ? r->yes : r->no)))
                return st;
            break;
        case OP_BININT1: {
            if ((st = rd_need(r, op_off, op, 1)))
                return st;
            pv_node_t *n = r->small_ints[arg[0]];
            if (!n && (n = node_alloc(r->doc, PV_INT)) != NULL) {
                n->v.i = arg[0];
                r->small_ints[arg[0]] = n;
            }
            r->pos += 1;
            if ((st = rd_push(r, n)))
                return st;
            break;
        }
        case OP_BININT2:
        case OP_BININT: {
            int width = op == OP_BININT2 ? 2 : 4;
            if ((st = rd_need(r, op_off, op, (size_t)width)))
                return st;
            uint64_t v = get_le(arg, width);
            pv_node_t *n = node_alloc(r->doc, PV_INT);
            if (n)
                n->v.i = op == OP_BININT ? (int64_t)(int32_t)(uint32_t)v : (int64_t)v;
            r->pos += (size_t)width;
            if ((st = rd_push(r, n)))
                return st;
            break;
        }
        case OP_LONG1:
        case OP_LONG4: {
            int width = op == OP_LONG1 ? 1 : 4;
            if ((st = rd_need(r, op_off, op, (size_t)width)))
                return st;
            uint64_t n = get_le(arg, width);
            if (op == OP_LONG4 && (n & 0x80000000u))
                return rd_error(r, op_off, "LONG4 with a negative byte count");
            r->pos += (size_t)width;
            if (n > r->size - r->pos)
                return rd_error(r, op_off, "truncated %s: length %llu exceeds the %zu bytes left",
                                op_name(op), (unsigned long long)n, r->size - r->pos);
            pv_node_t *node = node_from_le(r->doc, r->data + r->pos, (size_t)n);
            r->pos += (size_t)n;
            if ((st = rd_push(r, node)))
                return st;
            break;
        }
        case OP_INT:
        case OP_LONG:
            if ((st = rd_text_int(r, op_off, op)))
                return st;
            break;
        case OP_BINFLOAT: {
            if ((st = rd_need(r, op_off, op, 8)))
                return st;
            uint64_t bits = 0;
            for (int i = 0; i < 8; i++)
                bits = (bits << 8) | arg[i];
            pv_node_t *n = node_alloc(r->doc, PV_FLOAT);
            if (n)
                memcpy(&n->v.f, &bits, sizeof(bits));
            r->pos += 8;
            if ((st = rd_push(r, n)))
                return st;
            break;
        }
        case OP_SHORT_BINUNICODE:
        case OP_SHORT_BINBYTES:
        case OP_BINUNICODE:
        case OP_BINBYTES:
        case OP_BINUNICODE8:
        case OP_BINBYTES8:
        case OP_BYTEARRAY8: {
            int width = (op == OP_SHORT_BINUNICODE || op == OP_SHORT_BINBYTES) ? 1
                        : (op == OP_BINUNICODE || op == OP_BINBYTES) ? 4 : 8;
            bool is_str = op == OP_SHORT_BINUNICODE || op == OP_BINUNICODE || op == OP_BINUNICODE8;
            if ((st = rd_need(r, op_off, op, (size_t)width)))
                return st;
            uint64_t n = get_le(arg, width);
            r->pos += (size_t)width;
            if ((st = rd_blob(r, op_off, op, n, is_str ? PV_STR : PV_BYTES)))
                return st;
            break;
        }
        case OP_EMPTY_LIST:
        case OP_EMPTY_DICT:
        case OP_EMPTY_TUPLE: {
            pv_kind_t kind = op == OP_EMPTY_LIST ? PV_LIST : op == OP_EMPTY_DICT ? PV_DICT : PV_TUPLE;
            if ((st = rd_push(r, node_alloc(r->doc, kind))))
                return st;
            break;
        }
        case OP_TUPLE1:
        case OP_TUPLE2:
        case OP_TUPLE3: {
            size_t n = (size_t)(op - OP_TUPLE1 + 1);
            if ((st = rd_have(r, op_off, op, n)))
                return st;
            pv_node_t *t = rd_seq_from_stack(r, PV_TUPLE, r->sp - n);
            if ((st = rd_push(r, t)))
                return st;
            break;
        }
        case OP_TUPLE:
        case OP_LIST: {
            if ((st = rd_pop_mark(r, op_off, op, &mark)))
                return st;
            pv_node_t *s = rd_seq_from_stack(r, op == OP_TUPLE ? PV_TUPLE : PV_LIST, mark);
            if ((st = rd_push(r, s)))
                return st;
            break;
        }
        case OP_DICT: {
            if ((st = rd_pop_mark(r, op_off, op, &mark)))
                return st;
            pv_node_t *d = node_alloc(r->doc, PV_DICT);
            if (!d)
                return rd_oom();
            if ((st = rd_set_pairs(r, op_off, op, d, mark)) || (st = rd_push(r, d)))
                return st;
            break;
        }
        case OP_APPEND:
            if ((st = rd_have(r, op_off, op, 2)))
                return st;
            if ((st = rd_append(r, op_off, op, r->stack[r->sp - 2], r->sp - 1)))
                return st;
            break;
        case OP_APPENDS:
        case OP_SETITEMS:
            if ((st = rd_pop_mark(r, op_off, op, &mark)))
                return st;
            if (mark == 0 || mark - 1 < rd_fence(r))
                return rd_error(r, op_off, "stack underflow in %s (no container below the MARK)",
                                op_name(op));
            if (op == OP_APPENDS)
                st = rd_append(r, op_off, op, r->stack[mark - 1], mark);
            else
                st = rd_set_pairs(r, op_off, op, r->stack[mark - 1], mark);
            if (st)
                return st;
            break;
        case OP_SETITEM:
            if ((st = rd_have(r, op_off, op, 3)))
                return st;
            if ((st = rd_set_pairs(r, op_off, op, r->stack[r->sp - 3], r->sp - 2)))
                return st;
            break;
        case OP_BINPUT:
        case OP_LONG_BINPUT: {
            int width = op == OP_BINPUT ? 1 : 4;
            if ((st = rd_need(r, op_off, op, (size_t)width)))
                return st;
            r->pos += (size_t)width;
            if ((st = rd_memo_put(r, op_off, get_le(arg, width))))
                return st;
            break;
        }
        case OP_MEMOIZE:
            if ((st = rd_memo_put(r, op_off, r->memo_count)))
                return st;
            break;
        case OP_BINGET:
        case OP_LONG_BINGET: {
            int width = op == OP_BINGET ? 1 : 4;
            if ((st = rd_need(r, op_off, op, (size_t)width)))
                return st;
            r->pos += (size_t)width;
            if ((st = rd_memo_get(r, op_off, get_le(arg, width))))
                return st;
            break;
        }
        default:
            if (op >= 0x20 && op < 0x7f)
                return rd_error(r, op_off, "unsupported pickle opcode 0x%02x ('%c')", op, op);
            return rd_error(r, op_off, "unsupported pickle opcode 0x%02x", op);
        }
    }
}

static cca_status_t parse_pickle(const uint8_t *data, size_t size, pv_doc_t **out)
{
    cca_status_t st;
    reader_t *r = calloc(1, sizeof(*r));
    if (!r)
        return rd_oom();
    r->doc = pv_doc_new();
    if (!r->doc) {
        st = rd_oom();
        goto out_reader;
    }
    r->data = data;
    r->size = size;
    r->none = node_alloc(r->doc, PV_NONE);
    r->yes = node_alloc(r->doc, PV_BOOL);
    r->no = node_alloc(r->doc, PV_BOOL);
    if (!r->none || !r->yes || !r->no) {
        st = rd_oom();
        goto out_doc;
    }
    r->yes->v.b = true;
    st = rd_run(r);
    if (st)
        goto out_doc;
    *out = r->doc;
    r->doc = NULL;
out_doc:
    pv_doc_free(r->doc);
out_reader:
    free(r->stack);
    free(r->marks);
    free(r->memo);
    free(r);
    return st;
}

/* Inflate gzip data (possibly several members) into a malloc'd buffer. */
static cca_status_t gunzip(const uint8_t *data, size_t size, uint8_t **out, size_t *out_len)
{
    cca_status_t st = CCA_OK;
    z_stream zs;
    memset(&zs, 0, sizeof(zs));
    if (inflateInit2(&zs, 15 + 32) != Z_OK)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "pickle: cannot initialise zlib");
    /* The gzip trailer holds the size modulo 2^32: a good first guess. */
    size_t cap = size >= 4 ? (size_t)get_le(data + size - 4, 4) + 64 : 4096;
    if (cap > size * 1032 + 4096 || cap < size)
        cap = size * 4 + 4096;
    uint8_t *buf = malloc(cap);
    if (!buf) {
        st = rd_oom();
        goto out_zs;
    }
    size_t len = 0, in_pos = 0;
    for (;;) {
        if (len == cap) {
            size_t ncap = cap * 2;
            uint8_t *nbuf = ncap > cap ? realloc(buf, ncap) : NULL;
            if (!nbuf) {
                st = rd_oom();
                goto out_buf;
            }
            buf = nbuf;
            cap = ncap;
        }
        size_t in_chunk = size - in_pos > UINT32_MAX ? UINT32_MAX : size - in_pos;
        size_t out_chunk = cap - len > UINT32_MAX ? UINT32_MAX : cap - len;
        zs.next_in = (Bytef *)(uintptr_t)(data + in_pos);
        zs.avail_in = (uInt)in_chunk;
        zs.next_out = buf + len;
        zs.avail_out = (uInt)out_chunk;
        int zr = inflate(&zs, Z_NO_FLUSH);
        in_pos += in_chunk - zs.avail_in;
        len += out_chunk - zs.avail_out;
        if (zr == Z_STREAM_END) {
            /* Another gzip member may follow; anything else ends the data. */
            if (size - in_pos >= 2 && data[in_pos] == 0x1f && data[in_pos + 1] == 0x8b) {
                inflateReset(&zs);
                continue;
            }
            break;
        }
        if (zr == Z_OK)
            continue;
        if (zr == Z_BUF_ERROR && zs.avail_out == 0)
            continue;
        if (zr == Z_BUF_ERROR) {
            st = cca_raise(CCA_ERR_FORMAT, "pickle: truncated gzip data (%zu compressed bytes)", size);
            goto out_buf;
        }
        if (zr == Z_MEM_ERROR) {
            st = rd_oom();
            goto out_buf;
        }
        st = cca_raise(CCA_ERR_FORMAT, "pickle: corrupt gzip data: %s", zs.msg ? zs.msg : "inflate error");
        goto out_buf;
    }
    *out = buf;
    *out_len = len;
    buf = NULL;
out_buf:
    free(buf);
out_zs:
    inflateEnd(&zs);
    return st;
}

cca_status_t pickle_load_buffer(const void *data, size_t size, pv_doc_t **doc)
{
    if (!doc || (!data && size))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle_load_buffer: NULL argument");
    *doc = NULL;
    const uint8_t *bytes = data;
    if (size >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b) {
        uint8_t *raw = NULL;
        size_t raw_len = 0;
        cca_status_t st = gunzip(bytes, size, &raw, &raw_len);
        if (st)
            return st;
        st = parse_pickle(raw, raw_len, doc);
        free(raw);
        return st;
    }
    return parse_pickle(bytes, size, doc);
}

cca_status_t pickle_load_file(const char *path, pv_doc_t **doc)
{
    if (!path || !doc)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle_load_file: NULL argument");
    *doc = NULL;
    cca_status_t st = CCA_OK;
    FILE *f = fopen(path, "rb");
    if (!f)
        return cca_raise(CCA_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    struct stat sbuf;
    if (fstat(fileno(f), &sbuf) != 0) {
        st = cca_raise(CCA_ERR_IO, "cannot read %s: %s", path, strerror(errno));
        goto out_file;
    }
    if (!S_ISREG(sbuf.st_mode)) {
        st = cca_raise(CCA_ERR_IO, "cannot read %s: not a regular file", path);
        goto out_file;
    }
    size_t size = (size_t)sbuf.st_size;
    uint8_t *data = malloc(size ? size : 1);
    if (!data) {
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "pickle: out of memory reading %s (%zu bytes)", path, size);
        goto out_file;
    }
    if (size && fread(data, 1, size, f) != size) {
        st = cca_raise(CCA_ERR_IO, "cannot read %s: %s", path, ferror(f) ? strerror(errno) : "short read");
        goto out_data;
    }
    st = pickle_load_buffer(data, size, doc);
    if (st == CCA_ERR_FORMAT) {
        /* Name the file in the message. */
        char msg[sizeof(cca_last_error()->message)];
        snprintf(msg, sizeof(msg), "%s", cca_last_error()->message);
        cca_raise(CCA_ERR_FORMAT, "%s: %s", path, msg);
    }
out_data:
    free(data);
out_file:
    fclose(f);
    return st;
}

/* ---- writer ----------------------------------------------------------------------------- */

typedef struct wentry {
    const pv_node_t *node; /* NULL = empty slot */
    uint32_t memo;
} wentry_t;

typedef struct wmap {
    wentry_t *slots;
    size_t len, cap;       /* cap is a power of two */
    bool by_content;       /* str contents (else node identity) */
} wmap_t;

typedef struct writer {
    cca_strbuf_t *out;
    size_t frame_hdr;      /* offset of the current frame's 9-byte header */
    uint64_t memo_next;
    wmap_t containers;
    wmap_t strings;
} writer_t;

static uint64_t wmap_hash(const wmap_t *m, const pv_node_t *n)
{
    return m->by_content ? hash_mem(n->v.s.data, n->v.s.len) : mix64((uint64_t)(uintptr_t)n);
}

static bool wmap_same(const wmap_t *m, const pv_node_t *a, const pv_node_t *b)
{
    if (!m->by_content)
        return a == b;
    return a->v.s.len == b->v.s.len && memcmp(a->v.s.data, b->v.s.data, a->v.s.len) == 0;
}

static wentry_t *wmap_find(const wmap_t *m, const pv_node_t *n)
{
    if (!m->cap)
        return NULL;
    for (size_t slot = wmap_hash(m, n) & (m->cap - 1); m->slots[slot].node;
         slot = (slot + 1) & (m->cap - 1))
        if (wmap_same(m, m->slots[slot].node, n))
            return &m->slots[slot];
    return NULL;
}

static bool wmap_add(wmap_t *m, const pv_node_t *n, uint32_t memo)
{
    if ((m->len + 1) * 2 > m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 256;
        wentry_t *slots = calloc(cap, sizeof(*slots));
        if (!slots)
            return false;
        for (size_t i = 0; i < m->cap; i++) {
            if (!m->slots[i].node)
                continue;
            size_t slot = wmap_hash(m, m->slots[i].node) & (cap - 1);
            while (slots[slot].node)
                slot = (slot + 1) & (cap - 1);
            slots[slot] = m->slots[i];
        }
        free(m->slots);
        m->slots = slots;
        m->cap = cap;
    }
    size_t slot = wmap_hash(m, n) & (m->cap - 1);
    while (m->slots[slot].node)
        slot = (slot + 1) & (m->cap - 1);
    m->slots[slot].node = n;
    m->slots[slot].memo = memo;
    m->len++;
    return true;
}

static void w_bytes(writer_t *w, const void *p, size_t n)
{
    sb_appendn(w->out, p, n);
}

/* Start an opcode: close the current frame once it has reached its target size. */
static void w_op(writer_t *w, uint8_t op)
{
    if (w->out->len - w->frame_hdr - 9 >= PV_FRAME_TARGET && !w->out->failed) {
        uint64_t flen = w->out->len - w->frame_hdr - 9;
        for (int i = 0; i < 8; i++)
            w->out->data[w->frame_hdr + 1 + i] = (char)(flen >> (8 * i));
        w->frame_hdr = w->out->len;
        uint8_t hdr[9] = {OP_FRAME};
        w_bytes(w, hdr, sizeof(hdr));
    }
    w_bytes(w, &op, 1);
}

static void w_le(writer_t *w, uint64_t v, int n)
{
    uint8_t b[8];
    for (int i = 0; i < n; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    w_bytes(w, b, (size_t)n);
}

static cca_status_t w_get(writer_t *w, uint32_t memo)
{
    if (memo < 256) {
        w_op(w, OP_BINGET);
        w_le(w, memo, 1);
    } else {
        w_op(w, OP_LONG_BINGET);
        w_le(w, memo, 4);
    }
    return CCA_OK;
}

/* MEMOIZE the object just written and remember it in map. */
static cca_status_t w_memoize(writer_t *w, wmap_t *map, const pv_node_t *n)
{
    if (w->memo_next > UINT32_MAX)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle: more than 2^32 memoized objects");
    w_op(w, OP_MEMOIZE);
    if (!wmap_add(map, n, (uint32_t)w->memo_next))
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "pickle: out of memory writing");
    w->memo_next++;
    return CCA_OK;
}

static void w_sized(writer_t *w, uint8_t op1, uint8_t op4, uint8_t op8, const void *p, size_t n)
{
    if (n < 256 && op1) {
        w_op(w, op1);
        w_le(w, n, 1);
    } else if (n <= UINT32_MAX) {
        w_op(w, op4);
        w_le(w, n, 4);
    } else {
        w_op(w, op8);
        w_le(w, n, 8);
    }
    w_bytes(w, p, n);
}

static void w_int(writer_t *w, const pv_node_t *n)
{
    if (n->flags & PVF_U64) {
        w_op(w, OP_LONG1);
        w_le(w, 9, 1);
        w_le(w, n->v.u, 8);
        w_le(w, 0, 1);
        return;
    }
    int64_t v = n->v.i;
    if (v >= 0 && v <= 0xff) {
        w_op(w, OP_BININT1);
        w_le(w, (uint64_t)v, 1);
    } else if (v >= 0 && v <= 0xffff) {
        w_op(w, OP_BININT2);
        w_le(w, (uint64_t)v, 2);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
        w_op(w, OP_BININT);
        w_le(w, (uint64_t)v, 4);
    } else {
        uint8_t b[8];
        for (int i = 0; i < 8; i++)
            b[i] = (uint8_t)((uint64_t)v >> (8 * i));
        size_t len = bigint_minimal_len(b, 8);
        w_op(w, OP_LONG1);
        w_le(w, len, 1);
        w_bytes(w, b, len);
    }
}

static cca_status_t w_node(writer_t *w, const pv_node_t *n, int depth);

/* Items of a list or the pairs of a dict in batches of 1000, as Python writes them. */
static cca_status_t w_batches(writer_t *w, pv_node_t *const *items, size_t count, size_t per_item,
                              uint8_t one_op, uint8_t many_op, int depth)
{
    cca_status_t st;
    for (size_t start = 0; start < count; start += 1000) {
        size_t n = count - start < 1000 ? count - start : 1000;
        if (n > 1)
            w_op(w, OP_MARK);
        for (size_t i = start * per_item; i < (start + n) * per_item; i++)
            if ((st = w_node(w, items[i], depth + 1)))
                return st;
        w_op(w, n > 1 ? many_op : one_op);
    }
    return CCA_OK;
}

static cca_status_t w_node(writer_t *w, const pv_node_t *n, int depth)
{
    cca_status_t st;
    if (depth > PV_MAX_DEPTH)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle: value nested deeper than %d levels",
                         PV_MAX_DEPTH);
    switch (n->kind) {
    case PV_NONE: w_op(w, OP_NONE); return CCA_OK;
    case PV_BOOL: w_op(w, n->v.b ? OP_NEWTRUE : OP_NEWFALSE); return CCA_OK;
    case PV_INT: w_int(w, n); return CCA_OK;
    case PV_BIGINT:
        w_sized(w, OP_LONG1, OP_LONG4, 0, n->v.s.data, n->v.s.len);
        return CCA_OK;
    case PV_FLOAT: {
        uint64_t bits;
        memcpy(&bits, &n->v.f, sizeof(bits));
        uint8_t b[8];
        for (int i = 0; i < 8; i++)
            b[i] = (uint8_t)(bits >> (56 - 8 * i));
        w_op(w, OP_BINFLOAT);
        w_bytes(w, b, 8);
        return CCA_OK;
    }
    case PV_STR: {
        bool memo = n->v.s.len <= PV_MEMO_KEY_MAX;
        if (memo) {
            wentry_t *e = wmap_find(&w->strings, n);
            if (e)
                return w_get(w, e->memo);
        }
        w_sized(w, OP_SHORT_BINUNICODE, OP_BINUNICODE, OP_BINUNICODE8, n->v.s.data, n->v.s.len);
        return memo ? w_memoize(w, &w->strings, n) : CCA_OK;
    }
    case PV_BYTES:
        w_sized(w, OP_SHORT_BINBYTES, OP_BINBYTES, OP_BINBYTES8, n->v.s.data, n->v.s.len);
        return CCA_OK;
    default: break;
    }
    if (n->kind == PV_TUPLE && n->v.seq.len == 0) {
        w_op(w, OP_EMPTY_TUPLE);
        return CCA_OK;
    }
    wentry_t *e = wmap_find(&w->containers, n);
    if (e)
        return w_get(w, e->memo);
    if (n->kind == PV_LIST) {
        w_op(w, OP_EMPTY_LIST);
        if ((st = w_memoize(w, &w->containers, n)))
            return st;
        return w_batches(w, n->v.seq.items, n->v.seq.len, 1, OP_APPEND, OP_APPENDS, depth);
    }
    if (n->kind == PV_DICT) {
        w_op(w, OP_EMPTY_DICT);
        if ((st = w_memoize(w, &w->containers, n)))
            return st;
        return w_batches(w, n->v.dict.kv, n->v.dict.len, 2, OP_SETITEM, OP_SETITEMS, depth);
    }
    /* A tuple: its items, then TUPLEn; if an item refers back to the tuple it is
     * memoized by now, and the items are dropped in favour of the memo (as Python). */
    uint32_t count = n->v.seq.len;
    if (count > 3)
        w_op(w, OP_MARK);
    for (uint32_t i = 0; i < count; i++)
        if ((st = w_node(w, n->v.seq.items[i], depth + 1)))
            return st;
    e = wmap_find(&w->containers, n);
    if (e) {
        if (count > 3)
            w_op(w, OP_POP_MARK);
        else
            for (uint32_t i = 0; i < count; i++)
                w_op(w, OP_POP);
        return w_get(w, e->memo);
    }
    w_op(w, count > 3 ? OP_TUPLE : (uint8_t)(OP_TUPLE1 + count - 1));
    return w_memoize(w, &w->containers, n);
}

cca_status_t pickle_write_buffer(const pv_node_t *root, cca_strbuf_t *out)
{
    if (!root || !out)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle_write_buffer: NULL argument");
    writer_t w;
    memset(&w, 0, sizeof(w));
    w.out = out;
    w.strings.by_content = true;
    size_t start = out->len;
    uint8_t head[11] = {OP_PROTO, 4, OP_FRAME};
    w_bytes(&w, head, sizeof(head));
    w.frame_hdr = start + 2;
    cca_status_t st = w_node(&w, root, 0);
    if (!st) {
        w_op(&w, OP_STOP);
        if (out->failed) {
            st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "pickle: out of memory writing");
        } else {
            uint64_t flen = out->len - w.frame_hdr - 9;
            for (int i = 0; i < 8; i++)
                out->data[w.frame_hdr + 1 + i] = (char)(flen >> (8 * i));
        }
    }
    if (st && !out->failed && out->data) {
        out->len = start; /* drop the partial pickle */
        out->data[start] = '\0';
    }
    free(w.containers.slots);
    free(w.strings.slots);
    return st;
}

/* Write all of data to path (plain or gzip). */
static cca_status_t write_all(const char *path, const char *data, size_t len)
{
    size_t plen = strlen(path);
    bool gz = plen >= 3 && strcmp(path + plen - 3, ".gz") == 0;
    if (gz) {
        gzFile f = gzopen(path, "wb6");
        if (!f)
            return cca_raise(CCA_ERR_IO, "cannot create %s: %s", path,
                             errno ? strerror(errno) : "gzopen failed");
        size_t done = 0;
        while (done < len) {
            unsigned chunk = len - done > (1u << 30) ? (1u << 30) : (unsigned)(len - done);
            int wrote = gzwrite(f, data + done, chunk);
            if (wrote <= 0) {
                int zerr = 0;
                const char *msg = gzerror(f, &zerr);
                cca_status_t st = cca_raise(CCA_ERR_IO, "cannot write %s: %s", path,
                                            zerr == Z_ERRNO ? strerror(errno) : msg);
                gzclose(f);
                return st;
            }
            done += (size_t)wrote;
        }
        if (gzclose(f) != Z_OK)
            return cca_raise(CCA_ERR_IO, "cannot write %s: %s", path, strerror(errno));
        return CCA_OK;
    }
    FILE *f = fopen(path, "wb");
    if (!f)
        return cca_raise(CCA_ERR_IO, "cannot create %s: %s", path, strerror(errno));
    bool ok = fwrite(data, 1, len, f) == len;
    int err = errno;
    if (fclose(f) != 0 && ok) {
        ok = false;
        err = errno;
    }
    if (!ok)
        return cca_raise(CCA_ERR_IO, "cannot write %s: %s", path, strerror(err));
    return CCA_OK;
}

cca_status_t pickle_write_file(const pv_node_t *root, const char *path)
{
    if (!root || !path)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle_write_file: NULL argument");
    cca_strbuf_t sb;
    sb_init(&sb);
    cca_status_t st = pickle_write_buffer(root, &sb);
    if (!st)
        st = write_all(path, sb.data, sb.len);
    sb_free(&sb);
    return st;
}
