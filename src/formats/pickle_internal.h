/*
 * pickle_internal.h - the pickle value tree's records and the helpers its
 * files share: pickle.c (the arena-backed value tree, hashing, builders),
 * the decoder (pickle_decode.h) and pickle_write.c (the protocol-4 writer).
 */
#ifndef CCA_PICKLE_INTERNAL_H
#define CCA_PICKLE_INTERNAL_H

#include "pickle.h"

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

/* Pickle opcodes (the plain data subset). */
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

/* ---- pickle.c: the value tree ---------------------------------------------------------- */

/* size bytes (8-byte aligned) from doc's arena; NULL when out of memory. */
void *pv_arena_alloc(pv_doc_t *doc, size_t size);
/* A new node of kind from the arena; NULL when out of memory. */
pv_node_t *pv_node_alloc(pv_doc_t *doc, pv_kind_t kind);
/* A node (PV_STR, PV_BYTES, PV_BIGINT) holding a NUL-terminated arena copy of data. */
pv_node_t *pv_node_bytes(pv_doc_t *doc, pv_kind_t kind, const void *data, size_t len);
/* 64-bit mixing function, and a hash of len bytes built on it. */
uint64_t pv_mix64(uint64_t x);
uint64_t pv_hash_mem(const void *data, size_t len);
/* True if n can be a dict key (hashable, nested not too deep). */
bool pv_key_ok(const pv_node_t *n);
/* Make room for `extra` more pairs; false when out of memory or too many. */
bool pv_dict_reserve(pv_doc_t *doc, pv_node_t *d, size_t extra);
/* d[key] = value with room already reserved; the key must be hashable. */
void pv_dict_put_reserved(pv_node_t *d, pv_node_t *key, pv_node_t *value);
/* Make room for `extra` more items; false when out of memory or too many. */
bool pv_list_reserve(pv_doc_t *doc, pv_node_t *l, size_t extra);
/* Valid UTF-8 as Python's "surrogatepass" decoder accepts it. */
bool pv_utf8_valid(const unsigned char *p, size_t n);
/* Strip redundant sign bytes from a little-endian two's complement integer. */
size_t pv_bigint_minimal_len(const uint8_t *b, size_t n);
/* An integer node from little-endian two's complement bytes. */
pv_node_t *pv_node_from_le(pv_doc_t *doc, const uint8_t *b, size_t n);

#endif /* CCA_PICKLE_INTERNAL_H */
