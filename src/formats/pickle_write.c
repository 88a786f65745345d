/*
 * pickle_write.c - the protocol-4 pickle writer used for PyTorch memory
 * snapshots: 64 KiB frames, containers memoized (so shared nodes and cycles
 * survive) and repeated short strings memoized, as PyTorch's files are; to a
 * buffer, or to a file (gzip-compressed when its name ends in ".gz").
 * Invariant: nesting is bounded by PV_MAX_DEPTH, and a file is written only
 * once the whole pickle has been built in memory.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>

#include "pickle_internal.h"

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
    return m->by_content ? pv_hash_mem(n->v.s.data, n->v.s.len) : pv_mix64((uint64_t)(uintptr_t)n);
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
        size_t len = pv_bigint_minimal_len(b, 8);
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
