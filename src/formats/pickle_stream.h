/*
 * pickle_stream.h - a streaming reader for pickles shaped like PyTorch's
 * memory snapshots: a top-level dict whose fields are either kept as a tree
 * (pv_*), skipped, or, for a list of dicts (or a list of lists of dicts, as
 * `device_traces`), handed to a callback one dict ("record") at a time.
 *
 * The reader decompresses (gzip) and decodes in one pass over a small window
 * of the data: it never holds the whole file, the whole decompressed pickle,
 * or a tree of the streamed fields. What it keeps: the tree fields, the
 * records of one APPENDS batch (1,000 with Python's pickler), the memo (one
 * word per memo entry; streamed containers leave a marker there) and one copy
 * of each distinct short string; a str or bytes of 64 KiB or more is read
 * straight into the tree (held once), whatever its field.
 *
 * Which field a container belongs to is decided when the container begins, from
 * the stack (the MARK fences and the items below it), as Python's pickler lays
 * out dicts and lists; the choice is checked again when the container is
 * stored into its parent, so an input whose shape the reader misjudged fails
 * with CCA_ERR_FORMAT rather than giving wrong data. A record the pickle shares
 * through the memo is handed over at each place it occurs: from the tree when
 * a kept field holds it, else (a record handed over before, a skipped value
 * needed again, or a shape misjudged) the source is read a second time with
 * every field kept whole, the callbacks the first reading made not made again,
 * so the handler sees each call once and in order; only such files cost the
 * memory of a tree.
 * A records field whose value the pickle builds bottom-up (protocol 0's LIST
 * and DICT) arrives as a tree and its records are handed over from it. A
 * records key repeated at the top level streams the records of each value
 * (Python keeps only the last).
 *
 * Not thread-safe per call; separate calls are independent.
 */
#ifndef CCA_PICKLE_STREAM_H
#define CCA_PICKLE_STREAM_H

#include "pickle.h"

/* What to do with a top-level field. */
typedef enum pk_mode {
    PK_TREE = 0, /* keep it, in the tree the call returns */
    PK_SKIP,     /* decode and drop it */
    PK_RECORDS,  /* a list of dicts, or of lists of dicts: one callback per dict */
} pk_mode_t;

/* A scalar of a record (or a key), or the kind of a nested container. */
typedef struct pk_value {
    uint8_t kind;           /* pv_kind_t; PV_LIST/PV_TUPLE/PV_DICT: a container, content not kept */
    bool is_u64;            /* PV_INT holding 2^63 .. 2^64-1 (read num.u) */
    int32_t tag;            /* PV_STR: index of this text in the handler's symbols, else -1 */
    union {
        bool b;
        int64_t i;
        uint64_t u;
        double f;
    } num;                  /* PV_BOOL, PV_INT, PV_FLOAT */
    const char *data;       /* PV_STR, PV_BYTES, PV_BIGINT: the bytes (NUL-terminated), else NULL */
    size_t len;             /* bytes of data */
    const pv_node_t *node;  /* a value kept in the tree (shared through the memo), else NULL */
} pk_value_t;

typedef struct pk_field {
    pk_value_t key;
    pk_value_t value;
} pk_field_t;

/* One dict of a PK_RECORDS field; valid only during the callback. */
typedef struct pk_record {
    const char *field;      /* the top-level key */
    size_t group;           /* index of its inner list in the field's list (0 for a flat list) */
    size_t index;           /* index of the dict in its list */
    size_t count;           /* fields, in the order written (a repeated key counts twice) */
    /* by_tag[t]: the value stored under the key symbols[t] (the last one), NULL if absent */
    const pk_value_t *const *by_tag;
    const void *priv;       /* the reader's; read the fields with pk_record_field */
} pk_record_t;

/* Field i (< record->count) of a record, in the order written; false when out of range. */
bool pk_record_field(const pk_record_t *record, size_t i, pk_field_t *out);

typedef struct pk_handler {
    void *ctx;
    /* Texts the consumer wants to recognise without comparing strings: every
     * str equal to symbols[t] arrives with tag t (keys and values). */
    const char *const *symbols;
    size_t symbol_count;
    /* The mode of a top-level field, asked once when its value begins (NULL: all PK_TREE). */
    pk_mode_t (*field_mode)(void *ctx, const char *key, size_t len);
    /* A record; a status other than CCA_OK stops the reading and is returned. */
    cca_status_t (*record)(void *ctx, const pk_record_t *record);
    /* Optional: inner list `group` of the PK_RECORDS field `field` begins. */
    cca_status_t (*group)(void *ctx, const char *field, size_t group);
    /* A top-level value that is not a dict is refused (CCA_ERR_FORMAT) as soon as it
     * begins, before its bytes are read (a snapshot is a dict: a 2 GiB string is not). */
    bool dict_root;
} pk_handler_t;

/*
 * Read a pickle file (gunzipped on the fly when it starts with the gzip magic),
 * streaming as the handler says. On success *fields owns a dict of the
 * PK_TREE fields in file order (or, when the pickle's top value is not a dict,
 * that value as a tree). Returns CCA_OK, CCA_ERR_IO (names the path and errno
 * text), CCA_ERR_FORMAT (unsupported opcode, malformed or truncated data,
 * a records field that is not a list of dicts, a streamed value referenced
 * where a tree is kept: the message gives the offset in the decompressed
 * data), CCA_ERR_OUT_OF_MEMORY, CCA_ERR_INVALID_ARGUMENT (NULL arguments),
 * or the status a callback returned.
 */
cca_status_t pickle_stream_file(const char *path, const pk_handler_t *handler, pv_doc_t **fields);

/*
 * As pickle_stream_file from memory (gzip detected too), feeding the decoder
 * `chunk` bytes at a time (0: a default), so tests can cut the input anywhere.
 */
cca_status_t pickle_stream_buffer(const void *data, size_t size, size_t chunk,
                                  const pk_handler_t *handler, pv_doc_t **fields);

#endif /* CCA_PICKLE_STREAM_H */
