/*
 * pickle_reader.c - the entry points of the pickle decoder (pickle_decode.h):
 * the streaming reader (pickle_stream_file / _buffer) and the tree reader
 * (pickle_load_file / _buffer, every field kept), both over one machine
 * (pickle_stream.c) reading a window of the gunzipped data (pickle_input.c).
 *
 * A value the streaming reader dropped (a record handed over, a skipped
 * field) may be needed again when the pickle shares it through the memo; the
 * source is then read a second time keeping every field as a tree, the
 * callbacks the first reading made skipped (so the handler sees each once,
 * in order), which costs the memory of the tree only for such files.
 */
#include <errno.h>
#include <stdarg.h>
#include <sys/stat.h>

#include "pickle_decode.h"

/* ---- errors ----------------------------------------------------------------------------- */

const char *sr_op_name(int op)
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
    default: return "opcode";
    }
}

static cca_status_t raise_at(sreader_t *r, size_t off, const char *fmt, va_list ap)
{
    char text[256];
    vsnprintf(text, sizeof(text), fmt, ap);
    return cca_raise(CCA_ERR_FORMAT, "pickle: %s at offset %llu", text,
                     (unsigned long long)(r->in.base + off));
}

cca_status_t sr_error(sreader_t *r, size_t off, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    cca_status_t st = raise_at(r, off, fmt, ap);
    va_end(ap);
    return st;
}

cca_status_t sr_gone(sreader_t *r, size_t off, const char *fmt, ...)
{
    if (!r->keep_all)
        r->need_tree = true;
    va_list ap;
    va_start(ap, fmt);
    cca_status_t st = raise_at(r, off, fmt, ap);
    va_end(ap);
    return st;
}

cca_status_t sr_oom(void)
{
    return cca_raise(CCA_ERR_OUT_OF_MEMORY, "pickle: out of memory while reading");
}

/* ---- one reading ------------------------------------------------------------------------ */

/* Where the bytes come from: a file (rewound for a second reading) or memory. */
typedef struct source {
    FILE *file;
    uint64_t file_size;
    const uint8_t *mem;
    size_t mem_size;
    size_t chunk;     /* bytes per refill, 0: the default */
} source_t;

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

/* One reading of the source into r (zero-filled but for keep_all and calls_to_skip). */
static cca_status_t read_once(sreader_t *r, const source_t *src, const pk_handler_t *handler,
                              pv_doc_t **fields)
{
    cca_status_t st;
    if (src->file) {
        if (fseek(src->file, 0, SEEK_SET) != 0)
            return cca_raise(CCA_ERR_IO, "cannot read the pickle again: %s", strerror(errno));
        r->in.file = src->file;
        r->in.src_left = src->file_size;
    } else {
        r->in.mem = src->mem;
        r->in.mem_size = src->mem_size;
        r->in.src_left = src->mem_size;
    }
    r->in.chunk = src->chunk;
    r->h = handler;
    r->rec_base = SIZE_MAX;
    sr_keys_reset(&r->keys);
    size_t nt = handler->symbol_count ? handler->symbol_count : 1;
    r->doc = pv_doc_new();
    r->by_tag = calloc(nt, sizeof(*r->by_tag));
    r->tag_values = calloc(nt, sizeof(*r->tag_values));
    if (!r->doc || !r->by_tag || !r->tag_values)
        return sr_oom();
    if ((st = pk_input_start(&r->in)))
        return st;
    if ((st = sr_run(r)) || (st = pk_input_drain(&r->in)))
        return st;
    pv_doc_set_root(r->doc, r->result);
    *fields = r->doc;
    r->doc = NULL;
    return CCA_OK;
}

/* Read the source; again, keeping every field whole, when a dropped value was needed. */
static cca_status_t read_source(const source_t *src, const pk_handler_t *handler, pv_doc_t **fields)
{
    sreader_t r;
    memset(&r, 0, sizeof(r));
    cca_status_t st = read_once(&r, src, handler, fields);
    if (st != CCA_OK && r.need_tree) {
        uint64_t made = r.calls;
        sreader_free(&r);
        memset(&r, 0, sizeof(r));
        r.keep_all = true;
        r.calls_to_skip = made;
        st = read_once(&r, src, handler, fields);
    }
    sreader_free(&r);
    return st;
}

/* ---- entry points ----------------------------------------------------------------------- */

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
    source_t src = {.mem = data, .mem_size = size, .chunk = chunk};
    return read_source(&src, handler, fields);
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
    source_t src = {.file = f, .file_size = (uint64_t)sbuf.st_size};
    st = read_source(&src, handler, fields);
    if (st == CCA_ERR_FORMAT) {
        /* Name the file in the message (copied first: the message is the buffer raised into). */
        char msg[sizeof(cca_last_error()->message)];
        snprintf(msg, sizeof(msg), "%s", cca_last_error()->message);
        cca_raise(CCA_ERR_FORMAT, "%s: %s", path, msg);
    }
out_file:
    fclose(f);
    return st;
}

/* The tree reader: the same machine with every field kept. */
static const pk_handler_t keep_everything = {0};

cca_status_t pickle_load_buffer(const void *data, size_t size, pv_doc_t **doc)
{
    if (!doc || (!data && size))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle_load_buffer: NULL argument");
    return pickle_stream_buffer(data, size, 0, &keep_everything, doc);
}

cca_status_t pickle_load_file(const char *path, pv_doc_t **doc)
{
    if (!path || !doc)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "pickle_load_file: NULL argument");
    return pickle_stream_file(path, &keep_everything, doc);
}
