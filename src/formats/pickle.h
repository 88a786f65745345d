/*
 * pickle.h - Python pickle values as a tree (pv_*), the reader and writer of
 * PyTorch memory-snapshot pickles, and JSON rendering.
 *
 * A pv_doc_t owns every node of a tree in one arena: nodes, strings and item
 * arrays are bump-allocated and freed together by pv_doc_free; there is no
 * per-node malloc and no per-node free. Nodes may be shared: a pickle's memo
 * (BINPUT/MEMOIZE then BINGET) makes several parents point at one node, and a
 * list or dict may even contain itself, so a tree is in general a graph
 * (DAG or cyclic). That is fine for reading and freeing (the arena owns all
 * nodes); recursive walkers (writer, JSON) bound their depth and the writer
 * memoizes containers by identity, so sharing and cycles are preserved.
 *
 * Dicts are ordered (insertion order) and follow Python's rule for repeated
 * keys: setting an existing key replaces its value in place. Keys compare as
 * Python does for str, bytes, None, tuples (element-wise) and numbers (1,
 * True and 1.0 are one key); a float never equals a big int (a divergence
 * only for floats of 2^64 and beyond). Lists and dicts are not valid keys.
 *
 * Nothing here is thread-safe for a document being modified; concurrent
 * readers of a finished document are fine.
 */
#ifndef CCA_PICKLE_H
#define CCA_PICKLE_H

#include "internal.h"

typedef enum pv_kind {
    PV_NONE = 0,
    PV_BOOL,
    PV_INT,    /* int64, or uint64 when pv_is_u64() (values 2^63 .. 2^64-1) */
    PV_BIGINT, /* any other integer: little-endian two's complement bytes */
    PV_FLOAT,
    PV_STR,    /* UTF-8 (surrogates allowed, as Python's surrogatepass), NUL-terminated */
    PV_BYTES,  /* NUL-terminated too, for convenience (the NUL is not counted) */
    PV_LIST,
    PV_TUPLE,
    PV_DICT,
} pv_kind_t;

typedef struct pv_node pv_node_t;
typedef struct pv_doc pv_doc_t;

/* Limits of the reader and writer. */
#define PV_MAX_DEPTH 1000          /* nesting depth for writing and JSON (cycles stop here) */
#define PV_MEMO_KEY_MAX 64         /* strings up to this many bytes are memoized when written */
#define PV_FRAME_TARGET 65536      /* bytes per protocol-4 frame when writing */

/* ---- documents -------------------------------------------------------------- */

/* A new, empty document (root NULL); NULL when out of memory. */
pv_doc_t *pv_doc_new(void);
/* Free a document and every node in it. NULL is a no-op. */
void pv_doc_free(pv_doc_t *doc);
/* The root node (NULL for an empty builder document). */
const pv_node_t *pv_doc_root(const pv_doc_t *doc);
/* Set the root of a document to one of its nodes. */
void pv_doc_set_root(pv_doc_t *doc, pv_node_t *root);
/* Bytes the arena holds (for measurements). */
size_t pv_doc_arena_bytes(const pv_doc_t *doc);

/* ---- reading values ------------------------------------------------------------ */

pv_kind_t pv_kind(const pv_node_t *node);
/* Name of a kind ("none", "bool", "int", ...). */
const char *pv_kind_name(pv_kind_t kind);
/* Items of a list/tuple, pairs of a dict, bytes of a str/bytes/big int; else 0. */
size_t pv_len(const pv_node_t *node);
/* Item i of a list or tuple; NULL when out of range or not a sequence. */
const pv_node_t *pv_at(const pv_node_t *node, size_t i);
/* Key / value of pair i of a dict (insertion order); NULL when out of range. */
const pv_node_t *pv_dict_key_at(const pv_node_t *node, size_t i);
const pv_node_t *pv_dict_value_at(const pv_node_t *node, size_t i);
/* The value stored under the str key `key` in a dict; NULL if absent or not a dict. */
const pv_node_t *pv_dict_get(const pv_node_t *node, const char *key);
const pv_node_t *pv_dict_getn(const pv_node_t *node, const char *key, size_t key_len);

/* Typed getters: false (and *out untouched) on a kind or range mismatch. */
bool pv_is_none(const pv_node_t *node);
bool pv_get_bool(const pv_node_t *node, bool *out);
bool pv_get_int(const pv_node_t *node, int64_t *out);   /* PV_INT within int64 */
bool pv_get_u64(const pv_node_t *node, uint64_t *out);  /* PV_INT >= 0 */
bool pv_is_u64(const pv_node_t *node);                  /* PV_INT holding 2^63..2^64-1 */
bool pv_get_double(const pv_node_t *node, double *out); /* PV_FLOAT or PV_INT */
bool pv_get_str(const pv_node_t *node, const char **s, size_t *len);   /* len may be NULL */
bool pv_get_bytes(const pv_node_t *node, const uint8_t **data, size_t *len);
/* A big int's minimal little-endian two's complement bytes. */
bool pv_get_bigint(const pv_node_t *node, const uint8_t **data, size_t *len);
/* True when the str node equals the C string. */
bool pv_str_eq(const pv_node_t *node, const char *s);

/* ---- building values -------------------------------------------------------------
 * pv_new_* return NULL only on failure (out of memory, or invalid UTF-8 for a
 * str), having raised the error; the document remembers the first failure, and
 * pv_dict_set / pv_list_append given a NULL value return that status without
 * raising again, so a chain of calls needs one check at the end of each set.
 */
pv_node_t *pv_new_none(pv_doc_t *doc);
pv_node_t *pv_new_bool(pv_doc_t *doc, bool value);
pv_node_t *pv_new_int(pv_doc_t *doc, int64_t value);
pv_node_t *pv_new_u64(pv_doc_t *doc, uint64_t value);
/* Big int from little-endian two's complement bytes (normalized; may yield PV_INT). */
pv_node_t *pv_new_bigint(pv_doc_t *doc, const uint8_t *data, size_t len);
pv_node_t *pv_new_float(pv_doc_t *doc, double value);
pv_node_t *pv_new_str(pv_doc_t *doc, const char *s);
pv_node_t *pv_new_strn(pv_doc_t *doc, const char *s, size_t len);
/* A str from text that need not be UTF-8 (a program's context, an annotation): each byte that
 * begins no valid character becomes U+FFFD, as Python's errors="replace" decodes it. */
pv_node_t *pv_new_text(pv_doc_t *doc, const char *s, size_t len);
pv_node_t *pv_new_bytes(pv_doc_t *doc, const void *data, size_t len);
pv_node_t *pv_new_list(pv_doc_t *doc);
pv_node_t *pv_new_dict(pv_doc_t *doc);
/* A tuple of n existing nodes (copied; a NULL item fails like a NULL value). */
pv_node_t *pv_new_tuple(pv_doc_t *doc, size_t n, pv_node_t *const *items);

/*
 * Set dict[key] = value (key a C string, shared with other keys of the same
 * text in this document). Returns CCA_OK, CCA_ERR_OUT_OF_MEMORY,
 * CCA_ERR_INVALID_ARGUMENT (not a dict, bad key, NULL value with no earlier
 * failure), or the document's earlier failure for a NULL value.
 */
cca_status_t pv_dict_set(pv_doc_t *doc, pv_node_t *dict, const char *key, pv_node_t *value);
/* As pv_dict_set with any hashable node as key (not a list or dict). */
cca_status_t pv_dict_set_node(pv_doc_t *doc, pv_node_t *dict, pv_node_t *key, pv_node_t *value);
/* Append to a list. Same statuses as pv_dict_set. */
cca_status_t pv_list_append(pv_doc_t *doc, pv_node_t *list, pv_node_t *value);

/* ---- reader -------------------------------------------------------------------------- */

/*
 * Load a pickle (protocol 0-5 opcodes for None, bool, int, float, str, bytes,
 * list, tuple, dict) from a file, gunzipping it when it starts with the gzip
 * magic. The file is inflated and decoded a window at a time (the streaming
 * reader's decoder keeping every field), so bad data fails where it begins and
 * memory follows what the tree keeps. On success *doc owns the tree
 * (pv_doc_root). Returns CCA_OK,
 * CCA_ERR_IO (names the path and errno text), CCA_ERR_FORMAT (unsupported
 * opcode, malformed or truncated data: the message gives the offset, in the
 * decompressed data, and what was expected), CCA_ERR_OUT_OF_MEMORY,
 * CCA_ERR_INVALID_ARGUMENT (NULL arguments).
 */
cca_status_t pickle_load_file(const char *path, pv_doc_t **doc);
/* As pickle_load_file from memory (gzip detected too); data is not kept. */
cca_status_t pickle_load_buffer(const void *data, size_t size, pv_doc_t **doc);

/* ---- writer -------------------------------------------------------------------------- */

/*
 * Serialize a tree as a protocol-4 pickle with 64 KiB frames, memoizing
 * containers (so shared nodes and cycles survive) and repeated strings of up
 * to PV_MEMO_KEY_MAX bytes (dict keys), as PyTorch's files do. Appends to out.
 * Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (NULL root, unhashable dict key,
 * nesting deeper than PV_MAX_DEPTH), CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t pickle_write_buffer(const pv_node_t *root, cca_strbuf_t *out);
/* As pickle_write_buffer into a file, gzip-compressed when path ends in ".gz".
 * Adds CCA_ERR_IO (names the path and errno text). */
cca_status_t pickle_write_file(const pv_node_t *root, const char *path);

/* ---- JSON (json.c) ------------------------------------------------------------------- */

/*
 * Append a node as JSON: tuples as arrays, bytes as a base64 string (RFC 4648,
 * padded), big ints as exact decimal digits, non-finite floats as null,
 * finite floats with the shortest round-trip digits (always with a '.' or an
 * exponent), dict keys that are not str as the string of their JSON text
 * (e.g. 1 -> "1", None -> "null"). pretty: two-space indentation and
 * ": " / "," + newline separators, like Python's json.dumps(indent=2);
 * otherwise no whitespace at all. A shared node is written at each place it
 * occurs, so the text is bounded before anything is written: more than 2^20
 * values and more than 64 times the distinct ones (pv_json_values) is refused.
 * Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (NULL, nesting deeper than
 * PV_MAX_DEPTH, e.g. a cycle), CCA_ERR_FORMAT (shared values that would expand
 * past that bound: a "billion laughs" pickle), CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t pv_to_json(const pv_node_t *node, cca_strbuf_t *out, bool pretty);
/*
 * The values (scalars, containers and dict keys) pv_to_json would write,
 * saturating at UINT64_MAX, and the distinct ones (a container shared through
 * the memo counted once). Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (nesting
 * deeper than PV_MAX_DEPTH), CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t pv_json_values(const pv_node_t *node, uint64_t *values, uint64_t *distinct);

/* ---- shared between pickle.c and json.c --------------------------------------------- */

/* Decimal digits of a big int (little-endian two's complement) appended to out. */
void pv_bigint_to_decimal(const uint8_t *data, size_t len, cca_strbuf_t *out);

#endif /* CCA_PICKLE_H */
