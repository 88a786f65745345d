/*
 * pickle_read.c - the pickle reader: protocols 0-5, plain data opcodes only
 * (None, bool, int, float, str, bytes, list, tuple, dict), from memory or a
 * file, gzip-compressed input detected by its magic.
 *
 * Invariants: the reader never allocates more than a constant times the
 * input size (a length field is checked against the bytes left before
 * anything is allocated, memo indices are bounded by the input size) and
 * never recurses.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>

#include "pickle_internal.h"

/* ---- reader ------------------------------------------------------------------------------ */

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
    if (kind == PV_STR && !pv_utf8_valid(p, (size_t)n))
        return rd_error(r, op_off, "%s is not valid UTF-8", op_name(op));
    r->pos += (size_t)n;
    return rd_push(r, pv_node_bytes(r->doc, kind, p, (size_t)n));
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
    pv_node_t *n = pv_node_alloc(r->doc, PV_INT);
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
    pv_node_t *s = pv_node_alloc(r->doc, kind);
    if (!s || !n)
        return s;
    pv_node_t **items = pv_arena_alloc(r->doc, n * sizeof(pv_node_t *));
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
        if (!pv_key_ok(r->stack[i]))
            return rd_error(r, op_off, "unhashable dict key (%s) in %s",
                            pv_kind_name(r->stack[i]->kind), op_name(op));
    if (!pv_dict_reserve(r->doc, dict, (r->sp - from) / 2))
        return rd_oom();
    for (size_t i = from; i < r->sp; i += 2)
        pv_dict_put_reserved(dict, r->stack[i], r->stack[i + 1]);
    r->sp = from;
    return CCA_OK;
}

static cca_status_t rd_append(reader_t *r, size_t op_off, int op, pv_node_t *list, size_t from)
{
    if (list->kind != PV_LIST)
        return rd_error(r, op_off, "%s on a %s, not a list", op_name(op), pv_kind_name(list->kind));
    if (r->sp == from)
        return CCA_OK; /* an empty APPENDS */
    if (!pv_list_reserve(r->doc, list, r->sp - from))
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
            if (!n && (n = pv_node_alloc(r->doc, PV_INT)) != NULL) {
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
            pv_node_t *n = pv_node_alloc(r->doc, PV_INT);
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
            pv_node_t *node = pv_node_from_le(r->doc, r->data + r->pos, (size_t)n);
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
            pv_node_t *n = pv_node_alloc(r->doc, PV_FLOAT);
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
            if ((st = rd_push(r, pv_node_alloc(r->doc, kind))))
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
            pv_node_t *d = pv_node_alloc(r->doc, PV_DICT);
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
    r->none = pv_node_alloc(r->doc, PV_NONE);
    r->yes = pv_node_alloc(r->doc, PV_BOOL);
    r->no = pv_node_alloc(r->doc, PV_BOOL);
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
