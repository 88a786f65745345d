/*
 * pickle_stream.c - the streaming pickle reader (pickle_stream.h): decode in
 * one pass over a window of the (gunzipped) data, keeping tree fields as pv
 * trees and handing the dicts of records fields to a callback.
 *
 * Invariant: every value on the stack is a slot saying what became of it: a
 * scalar (strings interned once per distinct text), a value kept in the tree
 * (a pv node), a container dropped as it fills (skip), the top-level dict, a
 * records list (L1), an inner list of records (L2), or a record filling up.
 * A container's slot type is chosen when it begins and checked when its
 * parent takes it (see derive()); records live in a table reset whenever no
 * record is left on the stack, so memory stays bounded by one batch. The
 * bytes come from pickle_input.c's window.
 *
 * Longer than the house's 1,200 lines: it is one machine (the opcodes, the
 * rules deciding what each container becomes, the records and their fast
 * path) over one private slot type; split, that type would need a header for
 * files nothing else may call.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "pickle_input.h"
#include "pickle_internal.h"
#include "pickle_stream.h"

/* ---- opcodes (pickle_internal.h: the subset of the tree reader) ---------------------- */

static const char *sop_name(int op)
{
    switch (op) {
    case OP_APPEND: return "APPEND";
    case OP_APPENDS: return "APPENDS";
    case OP_SETITEM: return "SETITEM";
    case OP_SETITEMS: return "SETITEMS";
    case OP_DICT: return "DICT";
    case OP_LIST: return "LIST";
    case OP_TUPLE: return "TUPLE";
    case OP_TUPLE1: return "TUPLE1";
    case OP_TUPLE2: return "TUPLE2";
    case OP_TUPLE3: return "TUPLE3";
    case OP_POP: return "POP";
    case OP_POP_MARK: return "POP_MARK";
    case OP_DUP: return "DUP";
    case OP_STOP: return "STOP";
    case OP_LONG1: return "LONG1";
    case OP_LONG4: return "LONG4";
    case OP_INT: return "INT";
    case OP_LONG: return "LONG";
    case OP_SHORT_BINUNICODE: return "SHORT_BINUNICODE";
    case OP_BINUNICODE: return "BINUNICODE";
    case OP_BINUNICODE8: return "BINUNICODE8";
    case OP_SHORT_BINBYTES: return "SHORT_BINBYTES";
    case OP_BINBYTES: return "BINBYTES";
    case OP_BINBYTES8: return "BINBYTES8";
    case OP_BYTEARRAY8: return "BYTEARRAY8";
    case OP_BINPUT: return "BINPUT";
    case OP_LONG_BINPUT: return "LONG_BINPUT";
    case OP_MEMOIZE: return "MEMOIZE";
    case OP_BINGET: return "BINGET";
    case OP_LONG_BINGET: return "LONG_BINGET";
    default: return "opcode";
    }
}

/* ---- slots, symbols, records ------------------------------------------------------- */

enum slot_type {
    SL_SCALAR,  /* none, bool, int, float, or a symbol (str, bytes, big int) */
    SL_NODE,    /* a value kept in the tree */
    SL_SKIP,    /* a container whose content is dropped */
    SL_ROOT,    /* the top-level dict (its tree fields go to the fields dict) */
    SL_L1,      /* the list of a records field */
    SL_L2,      /* an inner list of records */
    SL_RECORD,  /* a record (dict) filling up */
};

#define SF_U64 0x01    /* SL_SCALAR PV_INT: v.u holds 2^63 .. 2^64-1 */
#define SF_FIELD 0x02  /* the value of a top-level field, its mode already applied */
#define SF_FILLED 0x04 /* a container that has taken items */

typedef struct pk_sym {
    const char *data;  /* NUL-terminated */
    size_t len;
    uint64_t hash;
    uint64_t word;     /* texts of up to 8 bytes: the bytes, little-endian (the recent cache's key) */
    int32_t tag;       /* index in the handler's symbols, -1 */
    uint32_t memo_id;  /* its index in the reader's memo_vals once memoized, else 0 */
    uint8_t kind;      /* PV_STR, PV_BYTES, PV_BIGINT */
} pk_sym_t;

typedef struct slot {
    uint8_t type;      /* enum slot_type */
    uint8_t kind;      /* pv_kind_t of the value */
    uint8_t flags;     /* SF_* */
    uint32_t n;        /* L1: items taken; L2: records taken */
    union {
        bool b;
        int64_t i;
        uint64_t u;
        double f;
        const pk_sym_t *sym;
        pv_node_t *node;   /* SL_NODE; SL_ROOT: the fields dict */
        uint64_t group;    /* SL_L2 */
        size_t rec;        /* SL_RECORD: index in the record table */
    } v;
} slot_t;

typedef struct rec {
    size_t start, count; /* its fields: slots start .. start + 2 * count (key, value pairs) */
    uint64_t keys_gen;   /* its keys are the key template's whole, as of this generation; 0: not */
} rec_t;

/* The private view a pk_record_t points at. */
typedef struct rec_view {
    const pk_handler_t *h;
    const slot_t *pairs;
    size_t count;
} rec_view_t;

/* Memo entries: 0 unset; odd: a dropped container ((kind << 2) | 1); else a
 * pointer: a pk_sym_t, or a pv_node_t with bit 1 set. */
#define MEMO_GONE(kind) (((uintptr_t)(kind) << 2) | 1u)
#define MEMO_NODE_BIT ((uintptr_t)2)

#define SHORT_SYM_MAX 64          /* strings up to this long are interned (deduplicated) */
#define ARENA_CHUNK ((size_t)64 * 1024)
#define FIXED_OP_MAX 16           /* the longest fixed-size opcode with its argument, and more */

#define FAST_FIELDS 32 /* a record with more fields takes the general path */

#define KEY_GET_MAX 5 /* the longest key the key template holds (LONG_BINGET) */

/*
 * The keys of the records read whole lately, by position: key i of a record
 * whose bytes there are op[i] (a BINGET or LONG_BINGET) is key[i], without a
 * look in the memo. An entry holds while the memo entry its get reads keeps
 * its value: the fast path only fills unset memo entries, and a store onto a
 * set one (memo_store) empties the template. (A key memoized again fails the
 * value read after it, and the record takes the general path.)
 */
typedef struct key_template {
    uint64_t op[FAST_FIELDS];   /* the get's bytes, little-endian, the rest zero; ~0: none */
    uint64_t mask[FAST_FIELDS]; /* its len bytes; 0 from count on, so that nothing matches */
    uint8_t len[FAST_FIELDS];   /* 2 (BINGET) or 5 (LONG_BINGET) */
    slot_t key[FAST_FIELDS];    /* the symbol it reads */
    size_t count;               /* entries 0 .. count - 1 are held */
    uint64_t gen;               /* changes whenever an entry does */
    /* what deliver() does with a record of exactly these keys (as of plan_gen): the
     * tagged fields, a repeated key's last one, and the set of their tags */
    uint8_t plan_pos[FAST_FIELDS];  /* the field */
    uint8_t plan_tag[FAST_FIELDS];  /* its key's tag (< 64) */
    size_t plan_count;
    uint64_t plan_tags;
    uint64_t plan_gen;              /* 0: no plan */
} key_template_t;

typedef struct arena_block {
    struct arena_block *next;
} arena_block_t;

typedef struct sreader {
    const pk_handler_t *h;
    pv_doc_t *doc;

    pk_input_t in;           /* the window of decompressed data */
    size_t fast_limit;       /* below it, opcodes run without window checks (see run()) */

    /* the machine */
    slot_t *stack;
    size_t sp, stack_cap;
    size_t *marks;
    size_t nmarks, marks_cap;
    /* memo[i]: an index in memo_vals (0: unset), 4 bytes an entry; a zero-filled array
     * (cca_zarray_grow) whose entries from memo_len on are unset and never read, so that
     * the pages past the last entry set are never touched */
    uint32_t *memo;
    uintptr_t *memo_vals;    /* the distinct values memoized (memo entries, below); [0] = 0 */
    size_t nvals, vals_cap;
    uint32_t gone_ids[16];   /* by kind: the memo_vals index of a dropped container, 0: none yet */
    size_t memo_len;         /* 1 + the highest index set */
    size_t memo_room;        /* entries allocated (memo_bytes of them) */
    size_t memo_count, memo_bytes;
    bool root_seen;
    pv_node_t *result;       /* the value STOP returned */

    /* symbols: an arena and an open-addressing table of the short ones */
    arena_block_t *blocks;
    char *arena_cur, *arena_end;
    pk_sym_t **syms;
    size_t nsyms, syms_cap;
    const pk_sym_t *recent[256]; /* texts of up to 8 bytes met recently, by a hash of their bytes */
    const pk_sym_t *last_short;  /* the str of up to 8 bytes the record fast path met last */

    /* records */
    rec_t *recs;
    size_t nrecs, recs_cap;
    slot_t *fields;
    size_t nfields, fields_cap; /* slots (two per field) */
    size_t rec_base;         /* lowest stack index holding a record; SIZE_MAX: none */
    const pk_sym_t *records_field;
    const pk_value_t **by_tag;
    pk_value_t *tag_values;
    uint64_t tags_set;       /* by_tag entries the last record set (symbol_count <= 64) */
    key_template_t keys;     /* the keys records were read with lately (record_fast) */
} sreader_t;

/* ---- errors and small helpers ------------------------------------------------------ */

static cca_status_t sr_error(sreader_t *r, size_t off, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* A format error at window offset off (reported as an offset in the whole data). */
static cca_status_t sr_error(sreader_t *r, size_t off, const char *fmt, ...)
{
    char text[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    return cca_raise(CCA_ERR_FORMAT, "pickle: %s at offset %llu", text,
                     (unsigned long long)(r->in.base + off));
}

static cca_status_t sr_oom(void)
{
    return cca_raise(CCA_ERR_OUT_OF_MEMORY, "pickle: out of memory while streaming");
}

static uint64_t le_bytes(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* Little-endian loads of 2, 4 and 8 bytes (pickle's integers). */
static inline uint16_t le16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static inline uint32_t le32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline uint64_t le64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* Grow *array (of *cap elements of size elem) to hold at least need elements. */
static bool grow(void *array, size_t *cap, size_t need, size_t elem, size_t first)
{
    if (need <= *cap)
        return true;
    size_t n = *cap ? *cap : first;
    while (n < need)
        n *= 2;
    void *p = realloc(*(void **)array, n * elem);
    if (!p)
        return false;
    *(void **)array = p;
    *cap = n;
    return true;
}

static const char *slot_kind_name(const slot_t *s)
{
    return pv_kind_name((pv_kind_t)s->kind);
}

static bool is_container(const slot_t *s)
{
    return s->type != SL_SCALAR && (s->kind == PV_LIST || s->kind == PV_DICT || s->kind == PV_TUPLE);
}

/* ---- symbols ------------------------------------------------------------------------ */

/* The tag of a text: its index in the handler's symbols, or -1. */
static int32_t tag_of(const pk_handler_t *h, const char *data, size_t len)
{
    for (size_t t = 0; t < h->symbol_count; t++)
        if (strlen(h->symbols[t]) == len && !memcmp(h->symbols[t], data, len))
            return (int32_t)t;
    return -1;
}

static void *arena_get(sreader_t *r, size_t size)
{
    size = (size + 7) & ~(size_t)7;
    if ((size_t)(r->arena_end - r->arena_cur) < size) {
        size_t bytes = size > ARENA_CHUNK ? size : ARENA_CHUNK;
        arena_block_t *b = malloc(sizeof(*b) + 8 + bytes);
        if (!b)
            return NULL;
        b->next = r->blocks;
        r->blocks = b;
        r->arena_cur = (char *)b + ((sizeof(*b) + 7) & ~(size_t)7);
        r->arena_end = r->arena_cur + bytes;
    }
    void *p = r->arena_cur;
    r->arena_cur += size;
    return p;
}

static uint64_t sym_hash(const uint8_t *p, size_t n, uint8_t kind)
{
    uint64_t h = 0xcbf29ce484222325ull ^ kind;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static pk_sym_t *sym_new(sreader_t *r, const uint8_t *p, size_t n, uint8_t kind, uint64_t hash)
{
    pk_sym_t *s = arena_get(r, sizeof(*s) + n + 1);
    if (!s)
        return NULL;
    char *data = (char *)(s + 1);
    memcpy(data, p, n);
    data[n] = 0;
    s->data = data;
    s->len = n;
    s->hash = hash;
    s->kind = kind;
    s->tag = -1;
    s->memo_id = 0;
    if (kind == PV_STR)
        s->tag = tag_of(r->h, (const char *)p, n);
    return s;
}

/*
 * The symbol for n bytes of kind (interned when short). A str is checked for
 * UTF-8 when its text is first met. Returns CCA_OK, CCA_ERR_FORMAT (invalid
 * UTF-8, for the opcode at off), CCA_ERR_OUT_OF_MEMORY.
 */
static cca_status_t sym_get(sreader_t *r, const uint8_t *p, size_t n, uint8_t kind, size_t off,
                            int op, const pk_sym_t **out)
{
    pk_sym_t *s;
    uint64_t word = 0;
    size_t slot = 0;
    if (n <= 8) {
        /* short texts ('N/A', '') recur in every event: one word compared */
        for (size_t i = 0; i < n; i++)
            word |= (uint64_t)p[i] << (8 * i);
        slot = (size_t)(((word ^ (n << 4) ^ kind) * 0x9e3779b97f4a7c15ull) >> 56);
        const pk_sym_t *c = r->recent[slot];
        if (c && c->word == word && c->len == n && c->kind == kind) {
            *out = c;
            return CCA_OK;
        }
    }
    if (n > SHORT_SYM_MAX) {
        if (kind == PV_STR && !pv_utf8_valid(p, n))
            return sr_error(r, off, "%s is not valid UTF-8", sop_name(op));
        if (!(s = sym_new(r, p, n, kind, 0)))
            return sr_oom();
        *out = s;
        return CCA_OK;
    }
    uint64_t h = sym_hash(p, n, kind);
    if (r->nsyms * 2 >= r->syms_cap) {
        size_t cap = r->syms_cap ? r->syms_cap * 2 : 1024;
        pk_sym_t **t = calloc(cap, sizeof(*t));
        if (!t)
            return sr_oom();
        for (size_t i = 0; i < r->syms_cap; i++) {
            pk_sym_t *e = r->syms[i];
            if (!e)
                continue;
            size_t j = e->hash & (cap - 1);
            while (t[j])
                j = (j + 1) & (cap - 1);
            t[j] = e;
        }
        free(r->syms);
        r->syms = t;
        r->syms_cap = cap;
    }
    size_t j = h & (r->syms_cap - 1);
    for (; (s = r->syms[j]) != NULL; j = (j + 1) & (r->syms_cap - 1))
        if (s->hash == h && s->len == n && s->kind == kind && !memcmp(s->data, p, n))
            break;
    if (!s) {
        if (kind == PV_STR && !pv_utf8_valid(p, n))
            return sr_error(r, off, "%s is not valid UTF-8", sop_name(op));
        if (!(s = sym_new(r, p, n, kind, h)))
            return sr_oom();
        s->word = word;
        r->syms[j] = s;
        r->nsyms++;
    }
    if (n <= 8)
        r->recent[slot] = s;
    *out = s;
    return CCA_OK;
}

/* Empty the key template: no entry matches any bytes. */
static void keys_reset(key_template_t *t)
{
    for (size_t i = 0; i < FAST_FIELDS; i++) {
        t->op[i] = ~(uint64_t)0;
        t->mask[i] = 0;
    }
    t->count = 0;
    t->gen++;
}

/* ---- the stack ---------------------------------------------------------------------- */

static __attribute__((noinline)) bool stack_grow(sreader_t *r)
{
    return grow(&r->stack, &r->stack_cap, r->sp + 1, sizeof(slot_t), 256);
}

/*
 * A new slot on top of the stack for the caller to fill in place (building a
 * slot elsewhere and copying it stalls on store forwarding); NULL when out of
 * memory (raised).
 */
static inline slot_t *push_slot(sreader_t *r)
{
    if (__builtin_expect(r->sp == r->stack_cap, 0) && !stack_grow(r)) {
        sr_oom();
        return NULL;
    }
    return &r->stack[r->sp++];
}

static inline cca_status_t push(sreader_t *r, const slot_t *s)
{
    slot_t *d = push_slot(r);
    if (!d)
        return CCA_ERR_OUT_OF_MEMORY;
    *d = *s;
    return CCA_OK;
}

static inline cca_status_t push_scalar(sreader_t *r, uint8_t kind, uint8_t flags, uint64_t bits)
{
    slot_t *d = push_slot(r);
    if (!d)
        return CCA_ERR_OUT_OF_MEMORY;
    d->type = SL_SCALAR;
    d->kind = kind;
    d->flags = flags;
    d->n = 0;
    d->v.u = bits;
    return CCA_OK;
}

/* Push a str / bytes / big int symbol. */
static inline cca_status_t push_sym(sreader_t *r, const pk_sym_t *sym)
{
    slot_t *d = push_slot(r);
    if (!d)
        return CCA_ERR_OUT_OF_MEMORY;
    d->type = SL_SCALAR;
    d->kind = sym->kind;
    d->flags = 0;
    d->n = 0;
    d->v.sym = sym;
    return CCA_OK;
}

/* Drop the stack down to n items; a record table with no record left is reset. */
static void pop_to(sreader_t *r, size_t n)
{
    r->sp = n;
    if (n <= r->rec_base)
        r->rec_base = SIZE_MAX;
}

static size_t fence(const sreader_t *r)
{
    return r->nmarks ? r->marks[r->nmarks - 1] : 0;
}

static cca_status_t have(sreader_t *r, size_t off, int op, size_t count)
{
    if (r->sp - fence(r) >= count)
        return CCA_OK;
    return sr_error(r, off, "stack underflow in %s (needs %zu items)", sop_name(op), count);
}

static cca_status_t pop_mark(sreader_t *r, size_t off, int op, size_t *mark)
{
    if (!r->nmarks)
        return sr_error(r, off, "%s without a MARK", sop_name(op));
    *mark = r->marks[--r->nmarks];
    return CCA_OK;
}

/* ---- values into the tree and into records ---------------------------------------------- */

/* The tree node for a slot; NULL (error raised) when it was streamed or skipped. */
static pv_node_t *to_node(sreader_t *r, const slot_t *s, size_t off)
{
    pv_node_t *n = NULL;
    if (s->type == SL_NODE)
        return s->v.node;
    if (s->type != SL_SCALAR) {
        sr_error(r, off, "a %s of a streamed or skipped field is referenced where values are kept",
                 slot_kind_name(s));
        return NULL;
    }
    switch (s->kind) {
    case PV_NONE: n = pv_new_none(r->doc); break;
    case PV_BOOL: n = pv_new_bool(r->doc, s->v.b); break;
    case PV_INT: n = (s->flags & SF_U64) ? pv_new_u64(r->doc, s->v.u) : pv_new_int(r->doc, s->v.i); break;
    case PV_FLOAT: n = pv_new_float(r->doc, s->v.f); break;
    case PV_STR: n = pv_new_strn(r->doc, s->v.sym->data, s->v.sym->len); break;
    case PV_BYTES: n = pv_new_bytes(r->doc, s->v.sym->data, s->v.sym->len); break;
    case PV_BIGINT:
        n = pv_new_bigint(r->doc, (const uint8_t *)s->v.sym->data, s->v.sym->len);
        break;
    default: break;
    }
    if (!n)
        sr_oom();
    return n;
}

/* A record field's value (or key) as the consumer sees it. */
static void to_value(const pk_handler_t *h, const slot_t *s, pk_value_t *v);

/* As to_value, inline for the common case (a scalar). */
static inline void to_value_fast(const pk_handler_t *h, const slot_t *s, pk_value_t *v)
{
    if (s->type != SL_SCALAR || s->kind == PV_BOOL) {
        to_value(h, s, v);
        return;
    }
    v->kind = s->kind;
    v->is_u64 = (s->flags & SF_U64) != 0;
    v->node = NULL;
    if (s->kind == PV_STR || s->kind == PV_BYTES || s->kind == PV_BIGINT) {
        v->data = s->v.sym->data;
        v->len = s->v.sym->len;
        v->tag = s->v.sym->tag;
        v->num.u = 0;
    } else {
        v->data = NULL;
        v->len = 0;
        v->tag = -1;
        v->num.u = s->v.u;
    }
}

static void to_value(const pk_handler_t *h, const slot_t *s, pk_value_t *v)
{
    v->kind = s->kind;
    v->is_u64 = s->type == SL_SCALAR && (s->flags & SF_U64);
    v->tag = -1;
    v->num.u = 0;
    v->data = NULL;
    v->len = 0;
    v->node = NULL;
    if (s->type == SL_SCALAR) {
        if (s->kind == PV_STR || s->kind == PV_BYTES || s->kind == PV_BIGINT) {
            v->data = s->v.sym->data;
            v->len = s->v.sym->len;
            v->tag = s->v.sym->tag;
        } else if (s->kind == PV_BOOL) {
            v->num.b = s->v.b;
        } else {
            v->num.u = s->v.u;
        }
        return;
    }
    if (s->type != SL_NODE)
        return;
    const pv_node_t *n = s->v.node;
    v->node = n;
    v->kind = (uint8_t)pv_kind(n);
    const uint8_t *bytes;
    switch (pv_kind(n)) {
    case PV_BOOL: pv_get_bool(n, &v->num.b); break;
    case PV_INT:
        v->is_u64 = pv_is_u64(n);
        if (v->is_u64)
            pv_get_u64(n, &v->num.u);
        else
            pv_get_int(n, &v->num.i);
        break;
    case PV_FLOAT: pv_get_double(n, &v->num.f); break;
    case PV_STR:
        pv_get_str(n, &v->data, &v->len);
        v->tag = tag_of(h, v->data, v->len);
        break;
    case PV_BYTES:
        pv_get_bytes(n, &bytes, &v->len);
        v->data = (const char *)bytes;
        break;
    case PV_BIGINT:
        pv_get_bigint(n, &bytes, &v->len);
        v->data = (const char *)bytes;
        break;
    default: break;
    }
}

bool pk_record_field(const pk_record_t *record, size_t i, pk_field_t *out)
{
    if (!record || !out || !record->priv)
        return false;
    const rec_view_t *view = record->priv;
    if (i >= view->count)
        return false;
    to_value(view->h, &view->pairs[2 * i], &out->key);
    to_value(view->h, &view->pairs[2 * i + 1], &out->value);
    return true;
}

/* ---- deciding what a new container becomes ---------------------------------------------- */

static cca_status_t new_tree_container(sreader_t *r, pv_kind_t kind, slot_t *out)
{
    out->type = SL_NODE;
    if (kind == PV_TUPLE)
        return CCA_OK; /* built from its items by the caller */
    out->v.node = kind == PV_LIST ? pv_new_list(r->doc) : pv_new_dict(r->doc);
    return out->v.node ? CCA_OK : sr_oom();
}

static inline cca_status_t new_record(sreader_t *r, size_t p, slot_t *out)
{
    if (r->rec_base == SIZE_MAX) {
        r->rec_base = p;
        r->nrecs = 0;
        r->nfields = 0;
    }
    if (!grow(&r->recs, &r->recs_cap, r->nrecs + 1, sizeof(rec_t), 1024))
        return sr_oom();
    r->recs[r->nrecs].start = r->nfields;
    r->recs[r->nrecs].count = 0;
    r->recs[r->nrecs].keys_gen = 0;
    out->type = SL_RECORD;
    out->v.rec = r->nrecs++;
    return CCA_OK;
}

static cca_status_t new_group(sreader_t *r, uint64_t group, slot_t *out)
{
    out->type = SL_L2;
    out->v.group = group;
    if (r->h->group)
        return r->h->group(r->h->ctx, r->records_field->data, (size_t)group);
    return CCA_OK;
}

/*
 * The slot of a new container of `kind` that will sit at stack index p (the
 * stack holds only what lies below it). Its parent is the list just below it
 * (APPEND style), the dict two below with a key between (SETITEM style; a dict
 * that already took items is passed over when a MARK offers another parent),
 * or else the container below the innermost MARK (APPENDS / SETITEMS style).
 */
static cca_status_t derive(sreader_t *r, size_t p, pv_kind_t kind, size_t off, slot_t *out)
{
    memset(out, 0, sizeof(*out));
    out->kind = (uint8_t)kind;
    if (p == 0) {
        if (kind == PV_DICT && !r->root_seen) {
            r->root_seen = true;
            out->type = SL_ROOT;
            out->v.node = pv_new_dict(r->doc);
            return out->v.node ? CCA_OK : sr_oom();
        }
        return new_tree_container(r, kind, out);
    }
    size_t f = fence(r), c;
    bool keyed = false, append_style = false;
    const slot_t *below = &r->stack[p - 1];
    if (p > f && is_container(below) && below->kind == PV_LIST) {
        c = p - 1;
        append_style = true;
    } else if (p > f + 1 && below->type == SL_SCALAR && is_container(&r->stack[p - 2]) &&
               r->stack[p - 2].kind == PV_DICT && (f == 0 || !(r->stack[p - 2].flags & SF_FILLED))) {
        c = p - 2;
        keyed = true;
    } else if (f > 0) {
        c = f - 1;
        keyed = (p - f) % 2 == 1;
    } else {
        return new_tree_container(r, kind, out);
    }
    const slot_t *parent = &r->stack[c];
    switch (parent->type) {
    case SL_NODE:
        return new_tree_container(r, kind, out);
    case SL_SKIP:
    case SL_RECORD:
        out->type = SL_SKIP;
        return CCA_OK;
    case SL_ROOT: {
        if (!keyed || below->type != SL_SCALAR || below->kind != PV_STR)
            return new_tree_container(r, kind, out);
        const pk_sym_t *key = below->v.sym;
        pk_mode_t mode = r->h->field_mode ? r->h->field_mode(r->h->ctx, key->data, key->len) : PK_TREE;
        out->flags = SF_FIELD;
        if (mode == PK_SKIP) {
            out->type = SL_SKIP;
            return CCA_OK;
        }
        if (mode != PK_RECORDS)
            return new_tree_container(r, kind, out);
        if (kind != PV_LIST)
            return sr_error(r, off, "field '%s' is a %s, not a list of records", key->data,
                            pv_kind_name(kind));
        out->type = SL_L1;
        r->records_field = key;
        return CCA_OK;
    }
    case SL_L1:
        if (kind == PV_DICT)
            return new_record(r, p, out);
        if (kind != PV_LIST)
            break;
        if (append_style)
            return new_group(r, parent->n, out);
        if (c == f - 1)
            return new_group(r, parent->n + (p - f), out);
        break;
    case SL_L2:
        if (kind == PV_DICT)
            return new_record(r, p, out);
        if (kind == PV_LIST && append_style && f > 0 && r->stack[f - 1].type == SL_L1)
            return new_group(r, r->stack[f - 1].n + (p - f), out);
        break;
    default:
        return new_tree_container(r, kind, out);
    }
    out->type = SL_SKIP; /* not a record: refused when its list takes it */
    return CCA_OK;
}

/* ---- taking items into containers ----------------------------------------------------------- */

/*
 * deliver()'s plan for a record whose keys are the key template's whole: the
 * tagged fields (of a key given twice, the last) and their tags, taken from the
 * template's keys. Needs symbol_count <= 64.
 */
static void plan_build(key_template_t *t)
{
    uint64_t tags = 0;
    size_t n = 0;
    for (size_t i = 0; i < t->count; i++) {
        const slot_t *k = &t->key[i];
        if (k->kind != PV_STR || k->v.sym->tag < 0)
            continue;
        uint8_t tag = (uint8_t)k->v.sym->tag;
        size_t j = n;
        if (tags & ((uint64_t)1 << tag))
            for (j = 0; t->plan_tag[j] != tag; j++)
                ;
        else
            n++;
        t->plan_pos[j] = (uint8_t)i;
        t->plan_tag[j] = tag;
        tags |= (uint64_t)1 << tag;
    }
    t->plan_count = n;
    t->plan_tags = tags;
    t->plan_gen = t->gen;
}

/*
 * Hand a record to the handler: by_tag[t] points at the value of the last field
 * whose key has tag t (its pk_value_t in tag_values), NULL where none has.
 * With up to 64 symbols, by_tag holds exactly the tags of tags_set between
 * calls, so that only the changes are written.
 */
static cca_status_t deliver(sreader_t *r, const slot_t *rs, uint64_t group, size_t index)
{
    const rec_t *rec = &r->recs[rs->v.rec];
    const slot_t *pairs = r->fields + rec->start;
    size_t nsym = r->h->symbol_count;
    uint64_t set = 0;
    const pk_value_t **by_tag = r->by_tag;
    pk_value_t *tag_values = r->tag_values;
    if (nsym <= 64 && rec->keys_gen && rec->keys_gen == r->keys.gen) {
        /* the template's keys: their tags are known */
        key_template_t *t = &r->keys;
        if (t->plan_gen != t->gen)
            plan_build(t);
        for (size_t j = 0; j < t->plan_count; j++)
            to_value_fast(r->h, &pairs[2 * t->plan_pos[j] + 1], &tag_values[t->plan_tag[j]]);
        set = t->plan_tags;
    } else {
        if (nsym > 64)
            memset(r->by_tag, 0, nsym * sizeof(*r->by_tag));
        size_t count = rec->count;
        for (size_t i = 0; i < count; i++) { /* locals: the stores below could alias the reader */
            const slot_t *k = &pairs[2 * i];
            int32_t t;
            const char *text;
            size_t len;
            if (k->type == SL_SCALAR && k->kind == PV_STR)
                t = k->v.sym->tag;
            else if (k->type == SL_NODE && pv_get_str(k->v.node, &text, &len))
                t = tag_of(r->h, text, len);
            else
                continue;
            if (t < 0)
                continue;
            to_value_fast(r->h, &pairs[2 * i + 1], &tag_values[t]);
            by_tag[t] = &tag_values[t];
            set |= (uint64_t)1 << (t & 63);
        }
    }
    if (nsym <= 64) {
        for (uint64_t m = r->tags_set & ~set; m; m &= m - 1)
            by_tag[__builtin_ctzll(m)] = NULL;
        for (uint64_t m = set & ~r->tags_set; m; m &= m - 1)
            by_tag[__builtin_ctzll(m)] = &tag_values[__builtin_ctzll(m)];
        r->tags_set = set;
    }
    rec_view_t view = {r->h, pairs, rec->count};
    pk_record_t out = {
        .field = r->records_field->data,
        .group = (size_t)group,
        .index = index,
        .count = rec->count,
        .by_tag = r->by_tag,
        .priv = &view,
    };
    return r->h->record ? r->h->record(r->h->ctx, &out) : CCA_OK;
}

/* list.append(item) for the items stack[from .. sp), then pop them. */
static cca_status_t take_items(sreader_t *r, size_t off, int op, slot_t *list, size_t from)
{
    cca_status_t st = CCA_OK;
    if (!is_container(list) || list->kind != PV_LIST)
        return sr_error(r, off, "%s on a %s, not a list", sop_name(op), slot_kind_name(list));
    if (r->sp > from)
        list->flags |= SF_FILLED;
    for (size_t i = from; i < r->sp && st == CCA_OK; i++) {
        slot_t *item = &r->stack[i];
        switch (list->type) {
        case SL_NODE: {
            pv_node_t *n = to_node(r, item, off);
            st = n ? pv_list_append(r->doc, list->v.node, n) : cca_last_error()->status;
            break;
        }
        case SL_SKIP:
            break;
        case SL_L1:
            if (item->type == SL_L2 && item->v.group == list->n) {
                list->n++;
            } else if (item->type == SL_RECORD) {
                st = deliver(r, item, 0, list->n++);
            } else {
                st = sr_error(r, off, "item %u of records field '%s' (a %s) is not a list of records",
                              list->n, r->records_field->data, slot_kind_name(item));
            }
            break;
        case SL_L2:
            if (item->type != SL_RECORD)
                st = sr_error(r, off, "item %u of a list of records is a %s, not a dict", list->n,
                              slot_kind_name(item));
            else
                st = deliver(r, item, list->v.group, list->n++);
            break;
        default:
            st = sr_error(r, off, "%s on a %s, not a list", sop_name(op), slot_kind_name(list));
        }
    }
    pop_to(r, from);
    return st;
}

/* The records of a records field that arrived as a tree (a shape decided only
 * at its end, as protocol 0's LIST / DICT build it): delivered from the tree. */
static cca_status_t deliver_tree(sreader_t *r, size_t off, const pk_sym_t *key, const pv_node_t *list)
{
    cca_status_t st = CCA_OK;
    r->records_field = key;
    if (pv_kind(list) != PV_LIST)
        return sr_error(r, off, "field '%s' is a %s, not a list of records", key->data,
                        pv_kind_name(pv_kind(list)));
    bool nested = pv_len(list) && pv_kind(pv_at(list, 0)) == PV_LIST;
    size_t saved = r->nrecs;
    r->nrecs = 0; /* no record is on the stack while a tree is taken */
    for (size_t g = 0; g < pv_len(list) && st == CCA_OK; g++) {
        const pv_node_t *inner = nested ? pv_at(list, g) : list;
        if (nested && pv_kind(inner) != PV_LIST)
            return sr_error(r, off, "item %zu of records field '%s' is not a list of records", g, key->data);
        if (nested && r->h->group && (st = r->h->group(r->h->ctx, key->data, g)))
            break;
        for (size_t i = 0; i < pv_len(inner) && st == CCA_OK; i++) {
            const pv_node_t *d = pv_at(inner, i);
            if (pv_kind(d) != PV_DICT)
                return sr_error(r, off, "item %zu of a list of records is a %s, not a dict", i,
                                pv_kind_name(pv_kind(d)));
            size_t n = 2 * pv_len(d);
            if (!grow(&r->fields, &r->fields_cap, n, sizeof(slot_t), 4096) ||
                !grow(&r->recs, &r->recs_cap, 1, sizeof(rec_t), 1024))
                return sr_oom();
            for (size_t j = 0; j < pv_len(d); j++) {
                const pv_node_t *kv[2] = {pv_dict_key_at(d, j), pv_dict_value_at(d, j)};
                for (int e = 0; e < 2; e++) {
                    slot_t *f = &r->fields[2 * j + (size_t)e];
                    memset(f, 0, sizeof(*f));
                    f->type = SL_NODE;
                    f->kind = (uint8_t)pv_kind(kv[e]);
                    f->v.node = (pv_node_t *)(uintptr_t)kv[e];
                }
            }
            r->recs[0].start = 0;
            r->recs[0].count = pv_len(d);
            r->recs[0].keys_gen = 0;
            slot_t rs = {.type = SL_RECORD, .kind = PV_DICT};
            rs.v.rec = 0;
            st = deliver(r, &rs, nested ? g : 0, i);
        }
        if (!nested)
            break;
    }
    r->nrecs = saved;
    r->nfields = 0;
    return st;
}

/*
 * Whether the top-level dict keeps k: v in the fields tree: a field whose mode
 * was applied when its value began keeps it if it became a tree; any other
 * value (a scalar, a value from the memo, a tree built before its place was
 * known) is kept, dropped or streamed now as its field's mode says.
 */
static bool root_keeps(sreader_t *r, size_t off, const slot_t *k, const slot_t *v, cca_status_t *st)
{
    if (v->flags & SF_FIELD)
        return v->type == SL_NODE;
    if (k->type != SL_SCALAR || k->kind != PV_STR || !r->h->field_mode)
        return true;
    pk_mode_t mode = r->h->field_mode(r->h->ctx, k->v.sym->data, k->v.sym->len);
    if (mode == PK_RECORDS && v->type == SL_NODE)
        *st = deliver_tree(r, off, k->v.sym, v->v.node);
    else if (mode == PK_RECORDS)
        *st = sr_error(r, off, "field '%s' is a %s, not a list of records", k->v.sym->data,
                       slot_kind_name(v));
    return mode == PK_TREE;
}

/* dict[k] = v for the stack pairs above `from`, then pop them. */
static cca_status_t take_pairs(sreader_t *r, size_t off, int op, slot_t *dict, size_t from)
{
    cca_status_t st = CCA_OK;
    if (!is_container(dict) || dict->kind != PV_DICT)
        return sr_error(r, off, "%s on a %s, not a dict", sop_name(op), slot_kind_name(dict));
    if ((r->sp - from) % 2)
        return sr_error(r, off, "odd number of items for %s", sop_name(op));
    for (size_t i = from; i < r->sp; i += 2)
        if (r->stack[i].kind == PV_LIST || r->stack[i].kind == PV_DICT)
            return sr_error(r, off, "unhashable dict key (%s) in %s", slot_kind_name(&r->stack[i]),
                            sop_name(op));
    if (r->sp > from)
        dict->flags |= SF_FILLED;
    if (dict->type == SL_RECORD) {
        rec_t *rec = &r->recs[dict->v.rec];
        size_t n = r->sp - from;
        if (rec->count && rec->start + 2 * rec->count != r->nfields)
            return sr_error(r, off, "the fields of two records are interleaved");
        if (!rec->count)
            rec->start = r->nfields;
        if (!grow(&r->fields, &r->fields_cap, r->nfields + n, sizeof(slot_t), 4096))
            return sr_oom();
        memcpy(r->fields + r->nfields, r->stack + from, n * sizeof(slot_t));
        r->nfields += n;
        rec->count += n / 2;
        rec->keys_gen = 0; /* its keys now differ from those it was read with */
        pop_to(r, from);
        return CCA_OK;
    }
    for (size_t i = from; i < r->sp && st == CCA_OK; i += 2) {
        slot_t *k = &r->stack[i], *v = &r->stack[i + 1];
        pv_node_t *kn, *vn;
        switch (dict->type) {
        case SL_SKIP:
            break;
        case SL_ROOT:
            if (!root_keeps(r, off, k, v, &st))
                break;
            __attribute__((fallthrough)); /* a tree field */
        case SL_NODE:
            kn = to_node(r, k, off);
            vn = kn ? to_node(r, v, off) : NULL;
            if (!kn || !vn) {
                st = cca_last_error()->status;
                break;
            }
            st = pv_dict_set_node(r->doc, dict->v.node, kn, vn);
            if (st == CCA_ERR_INVALID_ARGUMENT)
                st = sr_error(r, off, "unhashable dict key in %s", sop_name(op));
            break;
        default:
            st = sr_error(r, off, "%s on a %s, not a dict", sop_name(op), slot_kind_name(dict));
        }
    }
    pop_to(r, from);
    return st;
}

/* A tuple of the n items on top of the stack. */
static cca_status_t make_tuple(sreader_t *r, size_t off, size_t n)
{
    size_t from = r->sp - n;
    slot_t t;
    cca_status_t st = derive(r, from, PV_TUPLE, off, &t);
    if (st)
        return st;
    if (t.type == SL_NODE) {
        pv_node_t *small[8];
        pv_node_t **items = n <= 8 ? small : malloc(n * sizeof(*items));
        if (!items)
            return sr_oom();
        for (size_t i = 0; i < n && st == CCA_OK; i++)
            if (!(items[i] = to_node(r, &r->stack[from + i], off)))
                st = cca_last_error()->status;
        if (st == CCA_OK && !(t.v.node = pv_new_tuple(r->doc, n, items)))
            st = sr_oom();
        if (items != small)
            free(items);
        if (st)
            return st;
    } else {
        t.type = SL_SKIP;
    }
    pop_to(r, from);
    return push(r, &t);
}

/* LIST / DICT: a container holding the items above the mark. */
static cca_status_t make_from_mark(sreader_t *r, size_t off, int op, size_t mark)
{
    slot_t c;
    size_t top = r->sp;
    r->sp = mark; /* derive() looks only below the container */
    cca_status_t st = derive(r, mark, op == OP_LIST ? PV_LIST : PV_DICT, off, &c);
    r->sp = top;
    if (st)
        return st;
    if (r->sp == r->stack_cap && !grow(&r->stack, &r->stack_cap, r->sp + 1, sizeof(slot_t), 256))
        return sr_oom();
    memmove(r->stack + mark + 1, r->stack + mark, (r->sp - mark) * sizeof(slot_t));
    r->stack[mark] = c;
    r->sp++;
    if (c.type == SL_RECORD && r->rec_base > mark)
        r->rec_base = mark;
    if (op == OP_LIST)
        return take_items(r, off, op, &r->stack[mark], mark + 1);
    return take_pairs(r, off, op, &r->stack[mark], mark + 1);
}

/* ---- memo ------------------------------------------------------------------------------------- */

/* Room for n memo entries, the new ones unset; false when out of memory. */
static bool memo_reserve(sreader_t *r, size_t n)
{
    if (n > SIZE_MAX / sizeof(*r->memo) ||
        !cca_zarray_grow((void **)&r->memo, &r->memo_bytes, n * sizeof(*r->memo)))
        return false;
    r->memo_room = r->memo_bytes / sizeof(*r->memo);
    return true;
}

/*
 * The memo_vals index of memo entry e (a symbol, a node with MEMO_NODE_BIT, a
 * dropped container's MEMO_GONE), added when new: a symbol and a dropped
 * container's kind keep theirs, a node gets a new one. 0 when out of memory.
 */
static uint32_t memo_id_add(sreader_t *r, uintptr_t e);

static inline uint32_t memo_id_of(sreader_t *r, uintptr_t e)
{
    uint32_t id = 0;
    if (!(e & (1 | MEMO_NODE_BIT)))
        id = ((const pk_sym_t *)e)->memo_id;
    else if ((e & 1) && (e >> 2) < 16)
        id = r->gone_ids[e >> 2];
    return id ? id : memo_id_add(r, e);
}

static uint32_t memo_id_add(sreader_t *r, uintptr_t e)
{
    uint32_t *known = NULL;
    if (e & 1) {
        if ((e >> 2) < 16)
            known = &r->gone_ids[e >> 2];
    } else if (!(e & MEMO_NODE_BIT)) {
        known = &((pk_sym_t *)e)->memo_id; /* the reader's own symbol, const only to the decoder */
    }
    if (known && *known)
        return *known;
    if (r->nvals == r->vals_cap) {
        if (r->nvals >= UINT32_MAX ||
            !grow(&r->memo_vals, &r->vals_cap, r->nvals + 1, sizeof(uintptr_t), 256))
            return 0;
        if (!r->nvals)
            r->memo_vals[r->nvals++] = 0; /* index 0: unset */
    }
    uint32_t id = (uint32_t)r->nvals++;
    r->memo_vals[id] = e;
    if (known)
        *known = id;
    return id;
}

/* memo[idx] = e. Returns CCA_OK, CCA_ERR_FORMAT (a bogus index), CCA_ERR_OUT_OF_MEMORY. */
static cca_status_t memo_store(sreader_t *r, size_t off, uint64_t idx, uintptr_t e)
{
    /* A writer numbers memo slots from 0; an index beyond the data read so far is bogus. */
    if (idx > r->in.base + r->in.pos)
        return sr_error(r, off, "memo index %llu out of range", (unsigned long long)idx);
    uint32_t id = memo_id_of(r, e);
    if (!id || (idx >= r->memo_room && !memo_reserve(r, (size_t)idx + 1)))
        return sr_oom();
    if (idx >= r->memo_len) {
        r->memo_len = (size_t)idx + 1;
        r->memo_count++;
    } else if (!r->memo[idx]) {
        r->memo_count++;
    } else {
        keys_reset(&r->keys); /* a key's get may now read another value */
    }
    r->memo[idx] = id;
    return CCA_OK;
}

static cca_status_t memo_put(sreader_t *r, size_t off, uint64_t idx)
{
    if (r->sp <= fence(r))
        return sr_error(r, off, "memo store with an empty stack");
    const slot_t *s = &r->stack[r->sp - 1];
    uintptr_t e;
    if (s->type == SL_SCALAR && (s->kind == PV_STR || s->kind == PV_BYTES || s->kind == PV_BIGINT)) {
        e = (uintptr_t)s->v.sym;
    } else if (s->type == SL_SCALAR) {
        pv_node_t *n = to_node(r, s, off); /* boxed: scalars are rarely memoized */
        if (!n)
            return cca_last_error()->status;
        e = (uintptr_t)n | MEMO_NODE_BIT;
    } else if (s->type == SL_NODE || s->type == SL_ROOT) {
        e = (uintptr_t)s->v.node | MEMO_NODE_BIT; /* the top-level dict: as far as it is kept */
    } else {
        e = MEMO_GONE(s->kind);
    }
    return memo_store(r, off, idx, e);
}

static inline cca_status_t memo_get(sreader_t *r, size_t off, uint64_t idx)
{
    uintptr_t e = idx < r->memo_len ? r->memo_vals[r->memo[idx]] : 0;
    if (!e)
        return sr_error(r, off, "memo key %llu is not defined", (unsigned long long)idx);
    if (!(e & (1 | MEMO_NODE_BIT)))
        return push_sym(r, (const pk_sym_t *)e);
    slot_t *s = push_slot(r);
    if (!s)
        return CCA_ERR_OUT_OF_MEMORY;
    s->flags = 0;
    s->n = 0;
    if (e & 1) {
        s->type = SL_SKIP;
        s->kind = (uint8_t)(e >> 2);
        s->v.u = 0;
    } else {
        s->type = SL_NODE;
        s->v.node = (pv_node_t *)(e & ~MEMO_NODE_BIT);
        s->kind = (uint8_t)pv_kind(s->v.node);
    }
    return CCA_OK;
}

/* ---- records read whole ------------------------------------------------------------------- */

typedef struct pending_memo {
    uint64_t idx;
    uintptr_t e;
} pending_memo_t;

/* Whether the fast path's next MEMOIZE (at idx = memo_count + pending stores) may
 * store: its pending stores all lie below idx, so only the memo itself can hold it. */
static inline bool fast_memo_free(const sreader_t *r, uint64_t idx)
{
    return idx >= r->memo_len || !r->memo[idx];
}

/* The memo entry idx as the fast path sees it: pending stores first. 0: unset. */
static inline uintptr_t fast_memo(const sreader_t *r, const pending_memo_t *pm, int npm, uint64_t idx)
{
    if (idx < r->memo_count)
        return r->memo_vals[r->memo[idx]]; /* pending stores all lie at or above the count (<= memo_len) */
    for (int i = npm - 1; i >= 0; i--)
        if (pm[i].idx == idx)
            return pm[i].e;
    return idx < r->memo_len ? r->memo_vals[r->memo[idx]] : 0;
}

/*
 * One plain scalar at *p (and its memo store, if one follows) into *d, for
 * record_fast; false for anything else. The tests run from the most common
 * opcode of PyTorch's event dicts down; the window holds FIXED_OP_MAX bytes
 * at *p.
 */
static inline __attribute__((always_inline)) bool fast_scalar(sreader_t *r, const uint8_t **pp,
                                                              const uint8_t *end, slot_t *d,
                                                              pending_memo_t *pm, int *npm,
                                                              uint64_t *memo_next)
{
    const uint8_t *p = *pp;
    uint8_t op = *p;
    if (op == OP_LONG_BINGET || op == OP_BINGET) {
        uint64_t idx = op == OP_BINGET ? p[1] : le32(p + 1);
        uintptr_t e = idx < r->memo_count ? r->memo_vals[r->memo[idx]] : fast_memo(r, pm, *npm, idx);
        if (!e || (e & (1 | MEMO_NODE_BIT)))
            return false;
        const pk_sym_t *sym = (const pk_sym_t *)e;
        *d = (slot_t){.type = SL_SCALAR, .kind = sym->kind, .v.sym = sym};
        p += op == OP_BINGET ? 2 : 5;
    } else if (op == OP_LONG1) {
        size_t len = p[1];
        if (!len || len > 8 || (p[1 + len] & 0x80))
            return false;
        *d = (slot_t){.type = SL_SCALAR, .kind = PV_INT, .v.u = le64(p + 2) & (~(uint64_t)0 >> (64 - 8 * len))};
        p += 2 + len;
    } else if (op == OP_BININT1) {
        *d = (slot_t){.type = SL_SCALAR, .kind = PV_INT, .v.u = p[1]};
        p += 2;
    } else if (op == OP_SHORT_BINUNICODE) {
        size_t len = p[1];
        if ((size_t)(end - p) < 2 + len + 1)
            return false;
        /* the same short text as last time ('N/A' in every PyTorch event): one word
         * compared (the 8 bytes at p + 2 lie in the window, p being below its limit) */
        const pk_sym_t *sym = r->last_short;
        uint64_t word = len && len <= 8 ? le64(p + 2) & (~(uint64_t)0 >> (64 - 8 * len)) : 0;
        if (!sym || len > 8 || sym->len != len || sym->word != word) {
            if (sym_get(r, p + 2, len, PV_STR, (size_t)(p - r->in.buf), OP_SHORT_BINUNICODE, &sym) != CCA_OK)
                return false; /* the general path raises it again */
            if (len <= 8)
                r->last_short = sym;
        }
        *d = (slot_t){.type = SL_SCALAR, .kind = PV_STR, .v.sym = sym};
        p += 2 + len;
    } else if (op == OP_BININT2) {
        *d = (slot_t){.type = SL_SCALAR, .kind = PV_INT, .v.u = le16(p + 1)};
        p += 3;
    } else if (op == OP_BININT) {
        *d = (slot_t){.type = SL_SCALAR, .kind = PV_INT, .v.i = (int32_t)le32(p + 1)};
        p += 5;
    } else if (op == OP_NONE) {
        *d = (slot_t){.type = SL_SCALAR, .kind = PV_NONE};
        p += 1;
    } else if (op == OP_NEWTRUE || op == OP_NEWFALSE) {
        *d = (slot_t){.type = SL_SCALAR, .kind = PV_BOOL, .v.b = op == OP_NEWTRUE};
        p += 1;
    } else {
        return false;
    }
    if (*p == OP_MEMOIZE) {
        if (d->kind != PV_STR || !fast_memo_free(r, *memo_next))
            return false; /* a memoized number (boxed by the general path), or a set slot */
        pm[(*npm)++] = (pending_memo_t){(*memo_next)++, (uintptr_t)d->v.sym};
        p++;
    }
    *pp = p;
    return true;
}

/*
 * Put into the template the keys at the positions set in `learn`: memo gets
 * (op[i] their bytes) of a record just committed, kv its pairs. A position
 * past the template's end is left out, so that its entries stay contiguous.
 */
static void keys_learn(sreader_t *r, uint32_t learn, const uint64_t *op, const slot_t *kv)
{
    key_template_t *t = &r->keys;
    for (; learn; learn &= learn - 1) {
        size_t i = (size_t)__builtin_ctz(learn);
        if (i > t->count)
            break;
        t->op[i] = op[i];
        t->len[i] = (op[i] & 0xff) == OP_BINGET ? 2 : 5;
        t->mask[i] = ~(uint64_t)0 >> (64 - 8 * t->len[i]);
        t->key[i] = kv[2 * i];
        if (i == t->count)
            t->count++;
    }
    t->gen++;
}

/*
 * A record (a dict of a records list) whose EMPTY_DICT was just pushed: read
 * its body - an optional memo store, MARK, key / value pairs of plain scalars
 * each with an optional memo store, SETITEMS - in one go, with the effect the
 * opcodes one by one would have. Anything else (another opcode, the window
 * ending, an error to report) leaves everything as it was and returns false,
 * and the general path reads the record.
 */
static bool record_fast(sreader_t *r, slot_t *rec_slot)
{
    const uint8_t *p = r->in.buf + r->in.pos, *end = r->in.buf + r->in.end;
    pending_memo_t pm[2 * FAST_FIELDS + 1];
    int npm = 0;
    uint64_t memo_next = r->memo_count;
    size_t n = 0;
    /* the pairs are written in place after the record table's last field,
     * and counted in only when the whole body was read */
    if (end - p < FIXED_OP_MAX + KEY_GET_MAX ||
        !grow(&r->fields, &r->fields_cap, r->nfields + 2 * FAST_FIELDS, sizeof(slot_t), 4096))
        return false;
    slot_t *kv = r->fields + r->nfields;
    const uint8_t *limit = end - FIXED_OP_MAX;
    const uint8_t *key_limit = limit - KEY_GET_MAX; /* a template key leaves p below limit */
    /* the memo store of the dict itself */
    if (p < end && *p == OP_MEMOIZE) {
        if (!fast_memo_free(r, memo_next))
            return false; /* MEMOIZE onto a set slot: one by one it would not count */
        pm[npm++] = (pending_memo_t){memo_next++, MEMO_GONE(PV_DICT)};
        p++;
    }
    if (p >= end || *p != OP_MARK)
        return false;
    p++;
    /* a key, then its value: the key as the template has it at its position, else
     * read as a value is (a second site of the same tests, so that each site's
     * branches learn their own pattern); keys new to the template are noted */
    const key_template_t *t = &r->keys;
    bool templated = true;          /* every key so far read from the template */
    uint32_t learn = 0;             /* positions of memo-get keys the template lacks */
    uint64_t learn_op[FAST_FIELDS]; /* their bytes (set where `learn` has a bit) */
    for (;;) {
        if (__builtin_expect(p > key_limit || n == 2 * FAST_FIELDS, 0))
            return false;
        if (*p == OP_SETITEMS) {
            p++;
            break;
        }
        size_t i = n / 2;
        if ((le64(p) & t->mask[i]) == t->op[i]) {
            kv[n] = t->key[i];
            p += t->len[i];
        } else {
            const uint8_t *key = p;
            if (!fast_scalar(r, &p, end, &kv[n], pm, &npm, &memo_next) || __builtin_expect(p > limit, 0))
                return false;
            templated = false;
            if ((*key == OP_BINGET && p - key == 2) || (*key == OP_LONG_BINGET && p - key == 5)) {
                learn |= (uint32_t)1 << i;
                learn_op[i] = le64(key) & (~(uint64_t)0 >> (64 - 8 * (p - key)));
            }
        }
        if (!fast_scalar(r, &p, end, &kv[n + 1], pm, &npm, &memo_next))
            return false;
        n += 2;
    }
    rec_t *rec = &r->recs[rec_slot->v.rec];
    /* commit: the memo stores (MEMOIZE numbers them from the count, as one by one);
     * the memo grows first, so that no store can fail half way */
    if (npm && memo_next > r->memo_room && !memo_reserve(r, (size_t)memo_next))
        return false; /* out of memory: the general path raises it */
    uint32_t ids[2 * FAST_FIELDS + 1];
    for (int i = 0; i < npm; i++)
        if (!(ids[i] = memo_id_of(r, pm[i].e)))
            return false; /* likewise (values added stay unused) */
    for (int i = 0; i < npm; i++) {
        r->memo[pm[i].idx] = ids[i];
        r->memo_count++;
    }
    if (npm && memo_next > r->memo_len)
        r->memo_len = (size_t)memo_next;
    rec->keys_gen = templated && n / 2 == t->count ? t->gen : 0;
    if (learn)
        keys_learn(r, learn, learn_op, kv);
    rec->start = r->nfields;
    rec->count = n / 2;
    r->nfields += n;
    if (n)
        rec_slot->flags |= SF_FILLED;
    r->in.pos = (size_t)(p - r->in.buf);
    return true;
}

/*
 * Whether the `total` bytes of the opcode at pos are in the window. When they
 * are not and more data may come, the opcode is retried after a refill
 * (r->in.want); at the end of the data it is an error.
 */
static cca_status_t ready(sreader_t *r, size_t off, int op, uint64_t total, bool *ok)
{
    *ok = false;
    if (r->in.end - r->in.pos >= total) {
        *ok = true;
        return CCA_OK;
    }
    uint64_t avail = (uint64_t)(r->in.end - r->in.pos) + pk_input_left_bound(&r->in);
    if (total > avail)
        return sr_error(r, off, "truncated %s: needs %llu bytes, %llu left", sop_name(op),
                        (unsigned long long)total, (unsigned long long)(r->in.end - r->in.pos));
    r->in.want = (size_t)total;
    r->fast_limit = 0;
    return CCA_OK;
}

/* ---- the machine ------------------------------------------------------------------------------- */

static cca_status_t push_int_le(sreader_t *r, size_t off, int op, const uint8_t *b, size_t n)
{
    while (n > 1 && ((b[n - 1] == 0x00 && !(b[n - 2] & 0x80)) || (b[n - 1] == 0xff && (b[n - 2] & 0x80))))
        n--;
    if (n <= 8) {
        uint64_t u = le_bytes(b, (int)n);
        if (n && n < 8 && (b[n - 1] & 0x80))
            u |= ~(uint64_t)0 << (8 * n);
        return push_scalar(r, PV_INT, 0, u);
    }
    if (n == 9 && b[8] == 0)
        return push_scalar(r, PV_INT, SF_U64, le_bytes(b, 8));
    const pk_sym_t *sym;
    cca_status_t st = sym_get(r, b, n, PV_BIGINT, off, op, &sym);
    return st ? st : push_sym(r, sym);
}

/* Text INT / LONG (line already in the window, without its newline). */
static cca_status_t push_text_int(sreader_t *r, size_t off, int op, const char *s, size_t len)
{
    if (op == OP_INT && len == 2 && s[0] == '0' && (s[1] == '0' || s[1] == '1'))
        return push_scalar(r, PV_BOOL, 0, s[1] == '1');
    if (op == OP_LONG && len && s[len - 1] == 'L')
        len--;
    size_t i = 0;
    bool neg = false;
    if (i < len && (s[i] == '-' || s[i] == '+'))
        neg = s[i++] == '-';
    if (i == len)
        return sr_error(r, off, "%s: no digits", sop_name(op));
    uint64_t mag = 0;
    for (; i < len; i++) {
        if (s[i] < '0' || s[i] > '9')
            return sr_error(r, off, "%s: bad digit '%c'", sop_name(op), s[i]);
        unsigned d = (unsigned)(s[i] - '0');
        if (mag > (UINT64_MAX - d) / 10)
            return sr_error(r, off, "%s: integer beyond 64 bits is not supported", sop_name(op));
        mag = mag * 10 + d;
    }
    if (neg && mag > (uint64_t)INT64_MAX + 1)
        return sr_error(r, off, "%s: integer beyond 64 bits is not supported", sop_name(op));
    return push_scalar(r, PV_INT, (!neg && mag > (uint64_t)INT64_MAX) ? SF_U64 : 0,
                       neg ? (uint64_t)0 - mag : mag);
}

static cca_status_t push_container(sreader_t *r, size_t off, pv_kind_t kind)
{
    slot_t *s = push_slot(r); /* derive() looks only below it */
    if (!s)
        return CCA_ERR_OUT_OF_MEMORY;
    cca_status_t st = derive(r, r->sp - 1, kind, off, s);
    if (st == CCA_OK && kind == PV_TUPLE && s->type == SL_NODE) {
        if (!(s->v.node = pv_new_tuple(r->doc, 0, NULL)))
            st = sr_oom();
    } else if (kind == PV_TUPLE) {
        s->type = SL_SKIP;
    }
    if (st)
        pop_to(r, r->sp - 1);
    return st;
}

/*
 * Execute the opcode at pos. Sets r->in.want (and consumes nothing) when it needs
 * more data. checked: the window may hold less than FIXED_OP_MAX bytes.
 */
static inline __attribute__((always_inline)) cca_status_t step(sreader_t *r, bool *stop, bool checked)
{
    size_t off = r->in.pos;
    size_t left = r->in.end - r->in.pos;
    const uint8_t *p = r->in.buf + r->in.pos;
    int op = p[0];
    size_t mark = 0;
    bool ok = true;
    cca_status_t st = CCA_OK;
    /* fixed-size arguments: the window holds FIXED_OP_MAX bytes unless the data ends */
    static const uint8_t fixed[256] = {
        [OP_PROTO] = 2, [OP_FRAME] = 9, [OP_BININT1] = 2, [OP_BININT2] = 3, [OP_BININT] = 5,
        [OP_BINFLOAT] = 9, [OP_BINPUT] = 2, [OP_LONG_BINPUT] = 5, [OP_BINGET] = 2,
        [OP_LONG_BINGET] = 5, [OP_LONG1] = 2, [OP_LONG4] = 5, [OP_SHORT_BINUNICODE] = 2,
        [OP_SHORT_BINBYTES] = 2, [OP_BINUNICODE] = 5, [OP_BINBYTES] = 5, [OP_BINUNICODE8] = 9,
        [OP_BINBYTES8] = 9, [OP_BYTEARRAY8] = 9,
    };
    if (checked && fixed[op] > left)
        return sr_error(r, off, "truncated %s: needs %u argument bytes, %zu left", sop_name(op),
                        fixed[op] - 1u, left - 1);
    switch (op) {
    case OP_PROTO:
        if (p[1] > 5)
            return sr_error(r, off, "unsupported pickle protocol %d", p[1]);
        r->in.pos += 2;
        return CCA_OK;
    case OP_FRAME: {
        /* frames only group opcodes; the window does not need them, but a frame
         * longer than the data left is refused as pickle.c's reader does */
        uint64_t len = le64(p + 1);
        if (len > (uint64_t)(left - 9) + pk_input_left_bound(&r->in))
            return sr_error(r, off, "frame of %llu bytes exceeds the data left", (unsigned long long)len);
        r->in.pos += 9;
        return CCA_OK;
    }
    case OP_STOP:
        if ((st = have(r, off, op, 1)))
            return st;
        {
            slot_t *top = &r->stack[r->sp - 1];
            pv_node_t *root = top->type == SL_ROOT ? top->v.node : to_node(r, top, off);
            if (!root)
                return cca_last_error()->status;
            r->result = root;
        }
        r->in.pos += 1;
        *stop = true;
        r->fast_limit = 0;
        return CCA_OK;
    case OP_MARK:
        if (r->nmarks == r->marks_cap && !grow(&r->marks, &r->marks_cap, r->nmarks + 1, sizeof(size_t), 64))
            return sr_oom();
        r->marks[r->nmarks++] = r->sp;
        r->in.pos += 1;
        return CCA_OK;
    case OP_POP:
        if (r->nmarks && r->marks[r->nmarks - 1] == r->sp)
            r->nmarks--; /* as Python: POP right after MARK drops the mark */
        else if ((st = have(r, off, op, 1)))
            return st;
        else
            pop_to(r, r->sp - 1);
        r->in.pos += 1;
        return CCA_OK;
    case OP_POP_MARK:
        if ((st = pop_mark(r, off, op, &mark)))
            return st;
        pop_to(r, mark);
        r->in.pos += 1;
        return CCA_OK;
    case OP_DUP:
        if ((st = have(r, off, op, 1)))
            return st;
        {
            slot_t copy = r->stack[r->sp - 1];
            st = push(r, &copy);
        }
        r->in.pos += 1;
        return st;
    case OP_NONE:
        r->in.pos += 1;
        return push_scalar(r, PV_NONE, 0, 0);
    case OP_NEWTRUE:
    case OP_NEWFALSE:
        r->in.pos += 1;
        return push_scalar(r, PV_BOOL, 0, op == OP_NEWTRUE);
    case OP_BININT1:
        r->in.pos += 2;
        return push_scalar(r, PV_INT, 0, p[1]);
    case OP_BININT2:
        r->in.pos += 3;
        return push_scalar(r, PV_INT, 0, le16(p + 1));
    case OP_BININT:
        r->in.pos += 5;
        return push_scalar(r, PV_INT, 0, (uint64_t)(int64_t)(int32_t)le32(p + 1));
    case OP_BINFLOAT: {
        uint64_t bits = 0;
        for (int i = 1; i <= 8; i++)
            bits = (bits << 8) | p[i];
        r->in.pos += 9;
        return push_scalar(r, PV_FLOAT, 0, bits);
    }
    case OP_LONG1:
    case OP_LONG4: {
        int width = op == OP_LONG1 ? 1 : 4;
        uint64_t n = op == OP_LONG1 ? p[1] : le32(p + 1);
        if (op == OP_LONG4 && (n & 0x80000000u))
            return sr_error(r, off, "LONG4 with a negative byte count");
        if (op == OP_LONG1 && n && n <= 8 && left >= 10 && !(p[1 + n] & 0x80)) {
            /* the common case (addresses, times): a non-negative integer of up to
             * 8 bytes, loaded at once from the window */
            r->in.pos += 2 + (size_t)n;
            return push_scalar(r, PV_INT, 0, le64(p + 2) & (~(uint64_t)0 >> (64 - 8 * n)));
        }
        if ((st = ready(r, off, op, 1 + (uint64_t)width + n, &ok)) || !ok)
            return st;
        r->in.pos += 1 + (size_t)width + (size_t)n;
        return push_int_le(r, off, op, p + 1 + width, (size_t)n);
    }
    case OP_INT:
    case OP_LONG: {
        const uint8_t *nl = memchr(p + 1, '\n', left - 1);
        if (!nl)
            return ready(r, off, op, (uint64_t)left + 1, &ok); /* no newline yet */
        size_t len = (size_t)(nl - (p + 1));
        r->in.pos += len + 2;
        return push_text_int(r, off, op, (const char *)p + 1, len);
    }
    case OP_SHORT_BINUNICODE:
    case OP_SHORT_BINBYTES:
    case OP_BINUNICODE:
    case OP_BINBYTES:
    case OP_BINUNICODE8:
    case OP_BINBYTES8:
    case OP_BYTEARRAY8: {
        int width = fixed[op] - 1;
        bool is_str = op == OP_SHORT_BINUNICODE || op == OP_BINUNICODE || op == OP_BINUNICODE8;
        uint64_t n = width == 1 ? p[1] : width == 4 ? le32(p + 1) : le64(p + 1);
        if (n > UINT64_MAX / 2)
            return sr_error(r, off, "truncated %s: length %llu", sop_name(op), (unsigned long long)n);
        if ((st = ready(r, off, op, 1 + (uint64_t)width + n, &ok)) || !ok)
            return st;
        const pk_sym_t *sym;
        if ((st = sym_get(r, p + 1 + width, (size_t)n, is_str ? PV_STR : PV_BYTES, off, op, &sym)))
            return st;
        r->in.pos += 1 + (size_t)width + (size_t)n;
        return push_sym(r, sym);
    }
    case OP_EMPTY_DICT: {
        r->in.pos += 1;
        /* the next record of a batch (what derive() would decide, decided at once) */
        size_t f = fence(r);
        if (f > 0 && f <= r->sp && r->stack[f - 1].type == SL_L2 &&
            (r->sp == f || r->stack[r->sp - 1].type == SL_RECORD)) {
            slot_t *s = push_slot(r);
            if (!s)
                return CCA_ERR_OUT_OF_MEMORY;
            memset(s, 0, sizeof(*s));
            s->kind = PV_DICT;
            if ((st = new_record(r, r->sp - 1, s))) {
                pop_to(r, r->sp - 1);
                return st;
            }
        } else if ((st = push_container(r, off, PV_DICT))) {
            return st;
        }
        if (r->stack[r->sp - 1].type != SL_RECORD || !record_fast(r, &r->stack[r->sp - 1]))
            return CCA_OK;
        /* the records that follow, read here as the steps of their EMPTY_DICTs would
         * (the top of the stack is a record of the batch, so each is one too) */
        while (r->in.pos < r->fast_limit && r->in.buf[r->in.pos] == OP_EMPTY_DICT) {
            r->in.pos += 1;
            slot_t *s = push_slot(r);
            if (!s)
                return CCA_ERR_OUT_OF_MEMORY;
            memset(s, 0, sizeof(*s));
            s->kind = PV_DICT;
            if ((st = new_record(r, r->sp - 1, s))) {
                pop_to(r, r->sp - 1);
                return st;
            }
            if (!record_fast(r, s))
                break;
        }
        return CCA_OK;
    }
    case OP_EMPTY_LIST:
    case OP_EMPTY_TUPLE:
        r->in.pos += 1;
        return push_container(r, off, op == OP_EMPTY_LIST ? PV_LIST : PV_TUPLE);
    case OP_TUPLE1:
    case OP_TUPLE2:
    case OP_TUPLE3: {
        size_t n = (size_t)(op - OP_TUPLE1 + 1);
        if ((st = have(r, off, op, n)))
            return st;
        r->in.pos += 1;
        return make_tuple(r, off, n);
    }
    case OP_TUPLE:
        if ((st = pop_mark(r, off, op, &mark)))
            return st;
        r->in.pos += 1;
        return make_tuple(r, off, r->sp - mark);
    case OP_LIST:
    case OP_DICT:
        if ((st = pop_mark(r, off, op, &mark)))
            return st;
        r->in.pos += 1;
        return make_from_mark(r, off, op, mark);
    case OP_APPEND:
        if ((st = have(r, off, op, 2)))
            return st;
        r->in.pos += 1;
        return take_items(r, off, op, &r->stack[r->sp - 2], r->sp - 1);
    case OP_APPENDS:
    case OP_SETITEMS:
        if ((st = pop_mark(r, off, op, &mark)))
            return st;
        if (mark == 0 || mark - 1 < fence(r))
            return sr_error(r, off, "stack underflow in %s (no container below the MARK)", sop_name(op));
        r->in.pos += 1;
        if (op == OP_APPENDS)
            return take_items(r, off, op, &r->stack[mark - 1], mark);
        return take_pairs(r, off, op, &r->stack[mark - 1], mark);
    case OP_SETITEM:
        if ((st = have(r, off, op, 3)))
            return st;
        r->in.pos += 1;
        return take_pairs(r, off, op, &r->stack[r->sp - 3], r->sp - 2);
    case OP_BINPUT:
        r->in.pos += 2;
        return memo_put(r, off, p[1]);
    case OP_LONG_BINPUT:
        r->in.pos += 5;
        return memo_put(r, off, le32(p + 1));
    case OP_MEMOIZE:
        r->in.pos += 1;
        return memo_put(r, off, r->memo_count);
    case OP_BINGET:
        r->in.pos += 2;
        return memo_get(r, off, p[1]);
    case OP_LONG_BINGET:
        r->in.pos += 5;
        return memo_get(r, off, le32(p + 1));
    default:
        if (op >= 0x20 && op < 0x7f)
            return sr_error(r, off, "unsupported pickle opcode 0x%02x ('%c')", op, op);
        return sr_error(r, off, "unsupported pickle opcode 0x%02x", op);
    }
}

static cca_status_t run(sreader_t *r)
{
    bool stop = false;
    cca_status_t st;
    for (;;) {
        /* below fast_limit a whole fixed-size opcode is in the window and no
         * refill is pending (ready() and STOP lower the limit to 0) */
        while (r->in.pos < r->fast_limit)
            if ((st = step(r, &stop, false)))
                return st;
        if (stop)
            return CCA_OK;
        if (r->in.want || (r->in.end - r->in.pos < FIXED_OP_MAX && !r->in.eof)) {
            size_t need = r->in.want > FIXED_OP_MAX ? r->in.want : FIXED_OP_MAX;
            r->in.want = 0;
            if ((st = pk_input_fill(&r->in, need)))
                return st;
        }
        if (r->in.pos >= r->in.end)
            return sr_error(r, r->in.pos, "pickle ends without STOP");
        r->fast_limit = 0;
        if ((st = step(r, &stop, true)))
            return st;
        if (stop)
            return CCA_OK;
        if (!r->in.want && r->in.end >= FIXED_OP_MAX)
            r->fast_limit = r->in.end - FIXED_OP_MAX;
    }
}


/* ---- entry points -------------------------------------------------------------------------------- */

static void sreader_free(sreader_t *r)
{
    pk_input_close(&r->in);
    while (r->blocks) {
        arena_block_t *next = r->blocks->next;
        free(r->blocks);
        r->blocks = next;
    }
    free(r->stack);
    free(r->marks);
    cca_zarray_free(r->memo, r->memo_bytes);
    free(r->memo_vals);
    free(r->syms);
    free(r->recs);
    free(r->fields);
    free(r->by_tag);
    free(r->tag_values);
    pv_doc_free(r->doc);
}

/* Set up the reader over an opened source (file or memory) and run it. */
static cca_status_t stream_source(sreader_t *r, const pk_handler_t *handler, pv_doc_t **fields)
{
    cca_status_t st;
    r->h = handler;
    r->rec_base = SIZE_MAX;
    keys_reset(&r->keys);
    size_t nt = handler->symbol_count ? handler->symbol_count : 1;
    r->doc = pv_doc_new();
    r->by_tag = calloc(nt, sizeof(*r->by_tag));
    r->tag_values = calloc(nt, sizeof(*r->tag_values));
    if (!r->doc || !r->by_tag || !r->tag_values)
        return sr_oom();
    if ((st = pk_input_start(&r->in)))
        return st;
    if ((st = run(r)) || (st = pk_input_drain(&r->in)))
        return st;
    pv_doc_set_root(r->doc, r->result);
    *fields = r->doc;
    r->doc = NULL;
    return CCA_OK;
}

static bool handler_ok(const pk_handler_t *h)
{
    return h && (!h->symbol_count || h->symbols);
}

cca_status_t pickle_stream_buffer(const void *data, size_t size, size_t chunk,
                                  const pk_handler_t *handler, pv_doc_t **fields)
{
    if (!fields || (!data && size) || !handler_ok(handler))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle_stream_buffer: NULL argument");
    *fields = NULL;
    sreader_t r;
    memset(&r, 0, sizeof(r));
    r.in.mem = data;
    r.in.mem_size = size;
    r.in.src_left = size;
    r.in.chunk = chunk;
    cca_status_t st = stream_source(&r, handler, fields);
    sreader_free(&r);
    return st;
}

cca_status_t pickle_stream_file(const char *path, const pk_handler_t *handler, pv_doc_t **fields)
{
    if (!path || !fields || !handler_ok(handler))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle_stream_file: NULL argument");
    *fields = NULL;
    FILE *f = fopen(path, "rb");
    if (!f)
        return cca_raise(CCA_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    cca_status_t st;
    struct stat sbuf;
    if (fstat(fileno(f), &sbuf) != 0) {
        st = cca_raise(CCA_ERR_IO, "cannot read %s: %s", path, strerror(errno));
        goto out_file;
    }
    if (!S_ISREG(sbuf.st_mode)) {
        st = cca_raise(CCA_ERR_IO, "cannot read %s: not a regular file", path);
        goto out_file;
    }
    sreader_t r;
    memset(&r, 0, sizeof(r));
    r.in.file = f;
    r.in.src_left = (uint64_t)sbuf.st_size;
    st = stream_source(&r, handler, fields);
    sreader_free(&r);
    if (st == CCA_ERR_FORMAT) {
        char msg[sizeof(cca_last_error()->message)];
        snprintf(msg, sizeof(msg), "%s", cca_last_error()->message);
        cca_raise(CCA_ERR_FORMAT, "%s: %s", path, msg);
    }
out_file:
    fclose(f);
    return st;
}
