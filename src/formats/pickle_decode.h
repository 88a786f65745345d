/*
 * pickle_decode.h - the state of the pickle decoder that serves both the
 * streaming reader (pickle_stream.h) and the tree reader (pickle_load_*):
 * its slot type, symbols, record table and memo, shared by the files that
 * make it up and by nothing else:
 *
 *   pickle_stream.c   the machine: opcodes, stack, memo, symbols, what each container becomes
 *   pickle_records.c  records: handing them over, and the fast path reading them whole
 *   pickle_reader.c   set-up, entry points, the second reading of a shared value, errors
 *
 * Bytes come from pickle_input.c's window (gunzipped on the fly).
 */
#ifndef CCA_PICKLE_DECODE_H
#define CCA_PICKLE_DECODE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pickle_input.h"
#include "pickle_internal.h"
#include "pickle_stream.h"

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
    pv_node_t *node;   /* its node once kept in the tree (shared by every place it is kept) */
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
#define LARGE_BLOB ((uint64_t)64 * 1024) /* str / bytes this long go straight into the tree */
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
    bool dropped;            /* a field of the top-level dict was skipped or streamed */
    pv_node_t *result;       /* the value STOP returned */

    /* a second reading (sr_rerun): every field a tree, the callbacks the first made skipped */
    bool keep_all;           /* every value kept in the tree (the fields' modes applied at the end) */
    bool need_tree;          /* a dropped value is needed again: read again with keep_all */
    uint64_t calls;          /* group and record callbacks met so far */
    uint64_t calls_to_skip;  /* ... of which the first calls_to_skip are not made (made before) */

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


/* ---- small helpers ------------------------------------------------------------------- */

static inline uint64_t le_bytes(const uint8_t *p, int n)
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
static inline bool grow(void *array, size_t *cap, size_t need, size_t elem, size_t first)
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

static inline const char *slot_kind_name(const slot_t *s)
{
    return pv_kind_name((pv_kind_t)s->kind);
}

static inline bool is_container(const slot_t *s)
{
    return s->type != SL_SCALAR && (s->kind == PV_LIST || s->kind == PV_DICT || s->kind == PV_TUPLE);
}

/* ---- pickle_reader.c ------------------------------------------------------------------ */

/* The name of an opcode ("BINUNICODE"), "opcode" for an unknown one. */
const char *sr_op_name(int op);
/* A format error at window offset off (reported as an offset in the whole data). */
cca_status_t sr_error(sreader_t *r, size_t off, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
cca_status_t sr_oom(void);
/*
 * A value whose content was dropped (a streamed or skipped container) is
 * needed again at off: raises CCA_ERR_FORMAT with the message, and notes that
 * a second reading keeping every field whole would succeed (sr_rerun).
 */
cca_status_t sr_gone(sreader_t *r, size_t off, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* ---- pickle_stream.c ------------------------------------------------------------------ */

/* The tag of a text: its index in the handler's symbols, or -1. */
int32_t sr_tag_of(const pk_handler_t *h, const char *data, size_t len);
/* The symbol for n bytes of kind (interned when short). CCA_OK, CCA_ERR_FORMAT, CCA_ERR_OUT_OF_MEMORY. */
cca_status_t sr_sym_get(sreader_t *r, const uint8_t *p, size_t n, uint8_t kind, size_t off, int op,
                        const pk_sym_t **out);
/* Room for n memo entries; false when out of memory. */
bool sr_memo_reserve(sreader_t *r, size_t n);
/* The memo_vals index of memo entry e, added when new; 0 when out of memory. */
uint32_t sr_memo_id_add(sreader_t *r, uintptr_t e);
/* Run the machine to STOP. */
cca_status_t sr_run(sreader_t *r);

static inline uint32_t sr_memo_id_of(sreader_t *r, uintptr_t e)
{
    uint32_t id = 0;
    if (!(e & (1 | MEMO_NODE_BIT)))
        id = ((const pk_sym_t *)e)->memo_id;
    else if ((e & 1) && (e >> 2) < 16)
        id = r->gone_ids[e >> 2];
    return id ? id : sr_memo_id_add(r, e);
}

/* ---- pickle_records.c ----------------------------------------------------------------- */

/* A record field's value (or key) as the consumer sees it. */
void sr_to_value(const pk_handler_t *h, const slot_t *s, pk_value_t *v);
/* Hand the record in slot rs (index `index` of group `group`) to the handler. */
cca_status_t sr_deliver(sreader_t *r, const slot_t *rs, uint64_t group, size_t index);
/* Hand over the records of a records field that arrived as a tree (list: a pv list). */
cca_status_t sr_deliver_tree(sreader_t *r, size_t off, const pk_sym_t *key, const pv_node_t *list);
/* Hand over one record kept in the tree (dict: a pv dict). */
cca_status_t sr_deliver_node(sreader_t *r, const pv_node_t *dict, uint64_t group, size_t index);
/* The handler's group callback, unless a first reading made this call already. */
cca_status_t sr_call_group(sreader_t *r, const char *field, size_t group);
/* Empty the key template: no entry matches any bytes. */
void sr_keys_reset(key_template_t *t);
/* Read the body of the record just begun in rec_slot whole; false: the general path reads it. */
bool sr_record_fast(sreader_t *r, slot_t *rec_slot);

#endif /* CCA_PICKLE_DECODE_H */
