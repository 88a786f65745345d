/*
 * pickle_input.c - the window of decompressed bytes the streaming pickle
 * reader decodes from (pickle_input.h): read from a file or from memory,
 * gunzipped on the fly (several gzip members, as gzip does), the unconsumed
 * tail moved to the front on each refill. A gzip source read at the default
 * window is inflated on a second thread a few blocks ahead of the decoder.
 *
 * Invariant: buf[pos .. end) are the next bytes of the decompressed data,
 * which starts at offset base of the whole; eof: nothing follows end.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pickle_input.h"

#define IN_CHUNK ((size_t)64 * 1024)
#define DEFLATE_RATIO_MAX 1032    /* deflate never expands one byte into more */

static cca_status_t in_oom(void)
{
    return cca_raise(CCA_ERR_OUT_OF_MEMORY, "pickle: out of memory while streaming");
}

uint64_t pk_input_left_bound(const pk_input_t *in)
{
    if (in->eof)
        return 0;
    if (in->inf) /* the thread owns the source: bound by the whole compressed size */
        return in->gz_in_total * DEFLATE_RATIO_MAX + 65536;
    uint64_t compressed = in->src_left + (in->zs_live ? in->zs.avail_in : 0);
    return in->gz ? compressed * DEFLATE_RATIO_MAX + 65536 : compressed;
}

/* Read compressed (or raw) bytes from the source into dst; returns the count (0 at the end). */
static cca_status_t source_read(pk_input_t *in, uint8_t *dst, size_t max, size_t *got)
{
    *got = 0;
    if (in->file) {
        size_t n = fread(dst, 1, max, in->file);
        if (n < max && ferror(in->file))
            return cca_raise(CCA_ERR_IO, "cannot read the pickle: %s", strerror(errno));
        *got = n;
    } else {
        size_t n = in->mem_size - in->mem_pos;
        if (n > max)
            n = max;
        if (n)
            memcpy(dst, in->mem + in->mem_pos, n);
        in->mem_pos += n;
        *got = n;
    }
    in->src_left -= *got < in->src_left ? *got : in->src_left;
    return CCA_OK;
}

/* ---- CRC-32 of the gzip members ---------------------------------------------------------------- */

/*
 * zlib's check of the gzip CRC costs as much as inflating itself; it is turned
 * off (inflateValidate) and the CRC computed here instead, by folding 64 bytes
 * at a time with carry-less multiplication where the processor has it (the
 * method of Intel's "Fast CRC Computation for Generic Polynomials Using
 * PCLMULQDQ", with the constants of the gzip polynomial), and by zlib for the
 * rest. The trailer's CRC and length are compared as zlib would.
 */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* The raw (pre-inverted) CRC state over len bytes, len >= 64 and a multiple of 16. */
__attribute__((target("pclmul,sse4.1")))
static uint32_t crc_fold(const uint8_t *buf, size_t len, uint32_t crc)
{
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596, 0x0154442bd4);
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009e, 0x01751997d0);
    const __m128i k5 = _mm_set_epi64x(0, 0x0163cd6124);
    const __m128i poly = _mm_set_epi64x(0x01f7011641, 0x01db710641);
    const __m128i mask32 = _mm_setr_epi32(~0, 0, ~0, 0);
    __m128i x1 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
    __m128i x4 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    buf += 64;
    len -= 64;
    while (len >= 64) {
        __m128i x5 = _mm_clmulepi64_si128(x1, k1k2, 0x00);
        __m128i x6 = _mm_clmulepi64_si128(x2, k1k2, 0x00);
        __m128i x7 = _mm_clmulepi64_si128(x3, k1k2, 0x00);
        __m128i x8 = _mm_clmulepi64_si128(x4, k1k2, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k1k2, 0x11);
        x2 = _mm_clmulepi64_si128(x2, k1k2, 0x11);
        x3 = _mm_clmulepi64_si128(x3, k1k2, 0x11);
        x4 = _mm_clmulepi64_si128(x4, k1k2, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), _mm_loadu_si128((const __m128i *)(buf + 0x00)));
        x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), _mm_loadu_si128((const __m128i *)(buf + 0x10)));
        x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), _mm_loadu_si128((const __m128i *)(buf + 0x20)));
        x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), _mm_loadu_si128((const __m128i *)(buf + 0x30)));
        buf += 64;
        len -= 64;
    }
    __m128i x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
    x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
    x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
    x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
    x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
    x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);
    while (len >= 16) {
        x2 = _mm_loadu_si128((const __m128i *)buf);
        x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
        buf += 16;
        len -= 16;
    }
    /* 128 bits to 64, to 32, then Barrett reduction */
    x2 = _mm_clmulepi64_si128(x1, k3k4, 0x10);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, mask32);
    x1 = _mm_clmulepi64_si128(x1, k5, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    x2 = _mm_and_si128(x1, mask32);
    x2 = _mm_clmulepi64_si128(x2, poly, 0x10);
    x2 = _mm_and_si128(x2, mask32);
    x2 = _mm_clmulepi64_si128(x2, poly, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}

static bool have_clmul(void)
{
    static int known; /* 0: not asked yet, 1: yes, 2: no (a benign race: every thread finds the same) */
    int k = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (!k) {
        __builtin_cpu_init();
        k = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1") ? 1 : 2;
        __atomic_store_n(&known, k, __ATOMIC_RELAXED);
    }
    return k == 1;
}
#endif

uint32_t pk_crc32(uint32_t crc, const void *data, size_t len)
{
    const uint8_t *buf = data;
#if defined(__x86_64__) && defined(__GNUC__)
    if (len >= 64 && have_clmul()) {
        size_t n = len & ~(size_t)15;
        crc = ~crc_fold(buf, n, ~crc);
        buf += n;
        len -= n;
    }
#endif
    while (len) {
        size_t n = len > UINT32_MAX ? UINT32_MAX : len;
        crc = (uint32_t)crc32(crc, buf, (uInt)n);
        buf += n;
        len -= n;
    }
    return crc;
}

/* After the input consumed up to next_in: keep its last 8 bytes (a member's trailer at its end). */
static void keep_tail(pk_input_t *in, const uint8_t *from, const uint8_t *to)
{
    size_t n = (size_t)(to - from);
    if (n >= 8) {
        memcpy(in->gz_tail, to - 8, 8);
    } else if (n) {
        memmove(in->gz_tail, in->gz_tail + n, 8 - n);
        memcpy(in->gz_tail + 8 - n, from, n);
    }
}

static uint32_t le32_of(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/*
 * Inflate up to room bytes into dst: *made bytes written, *ended set at the end
 * of the data. Returns once something was made, or at the end. Runs on the
 * consumer or, in threaded mode, only on the inflating thread.
 */
static cca_status_t inflate_into(pk_input_t *in, uint8_t *dst, size_t room, size_t *made, bool *ended)
{
    *made = 0;
    *ended = false;
    while (room) {
        if (!in->zs.avail_in) {
            size_t got = 0;
            cca_status_t st = source_read(in, in->zin, in->chunk < IN_CHUNK ? in->chunk : IN_CHUNK, &got);
            if (st)
                return st;
            if (!got) {
                if (in->z_end) {
                    *ended = true;
                    return CCA_OK;
                }
                return cca_raise(CCA_ERR_FORMAT, "pickle: truncated gzip data");
            }
            in->zs.next_in = in->zin;
            in->zs.avail_in = (uInt)got;
        }
        if (in->z_end) {
            /* Another gzip member may follow; anything else ends the data. */
            if (in->zs.avail_in >= 2 && in->zs.next_in[0] == 0x1f && in->zs.next_in[1] == 0x8b) {
                inflateReset(&in->zs); /* keeps the check off */
                in->z_end = false;
                in->gz_crc = 0;
                in->gz_out = 0;
            } else {
                *ended = true;
                return CCA_OK;
            }
        }
        size_t n = room > UINT32_MAX ? UINT32_MAX : room;
        const uint8_t *consumed_from = in->zs.next_in;
        in->zs.next_out = dst + *made;
        in->zs.avail_out = (uInt)n;
        int zr = inflate(&in->zs, Z_NO_FLUSH);
        size_t got = n - in->zs.avail_out;
        keep_tail(in, consumed_from, in->zs.next_in);
        in->gz_crc = pk_crc32(in->gz_crc, dst + *made, got);
        in->gz_out += got;
        *made += got;
        room -= got;
        if (zr == Z_STREAM_END) {
            /* the member's trailer (CRC-32, then the length modulo 2^32) was the last input read */
            if (le32_of(in->gz_tail) != in->gz_crc)
                return cca_raise(CCA_ERR_FORMAT, "pickle: corrupt gzip data: incorrect data check");
            if (le32_of(in->gz_tail + 4) != (uint32_t)in->gz_out)
                return cca_raise(CCA_ERR_FORMAT, "pickle: corrupt gzip data: incorrect length check");
            in->z_end = true;
            if (!in->zs.avail_in && !in->src_left) {
                *ended = true;
                return CCA_OK;
            }
        } else if (zr == Z_MEM_ERROR) {
            return in_oom();
        } else if (zr != Z_OK && zr != Z_BUF_ERROR) {
            return cca_raise(CCA_ERR_FORMAT, "pickle: corrupt gzip data: %s",
                             in->zs.msg ? in->zs.msg : "inflate error");
        }
        if (*made)
            return CCA_OK; /* something new to decode */
    }
    return CCA_OK;
}

/* ---- the inflating thread ------------------------------------------------------------------ */

/*
 * A gzip file read at the default window is inflated on a second thread, a
 * few blocks ahead of the decoder, so decompressing and decoding overlap. The
 * blocks go through a queue in order; the thread stops at the end of the data,
 * on an error (which the decoder raises again when it reaches that point), or
 * when the decoder is done.
 */
#define TBLOCK ((size_t)256 * 1024)
#define TBLOCKS 4

#define TBLOCK_HEAD ((size_t)4096) /* room before a block's data for the window's unread tail */

typedef struct tblock {
    struct tblock *next;
    size_t len;
    uint8_t head[TBLOCK_HEAD];
    uint8_t data[TBLOCK];
} tblock_t;

struct inflater {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t to_decoder, to_inflater;
    tblock_t *ready_head, *ready_tail; /* inflated, in order */
    tblock_t *spare;                   /* empty */
    bool finished;                     /* the thread stopped: end of data, or `status` */
    bool cancel;                       /* the decoder needs nothing more */
    cca_status_t status;
    char message[sizeof(((cca_error_t *)0)->message)];
};

static void *inflater_main(void *arg)
{
    pk_input_t *in = arg;
    struct inflater *t = in->inf;
    cca_status_t st = CCA_OK;
    bool ended = false;
    while (!ended) {
        pthread_mutex_lock(&t->mu);
        while (!t->spare && !t->cancel)
            pthread_cond_wait(&t->to_inflater, &t->mu);
        if (t->cancel) { /* (a block taken now would be on no list) */
            pthread_mutex_unlock(&t->mu);
            break;
        }
        tblock_t *b = t->spare; /* every block was made by inflater_start */
        t->spare = b->next;
        pthread_mutex_unlock(&t->mu);
        b->len = 0;
        while (b->len < TBLOCK && !ended && st == CCA_OK) {
            size_t made = 0;
            st = inflate_into(in, b->data + b->len, TBLOCK - b->len, &made, &ended);
            b->len += made;
        }
        pthread_mutex_lock(&t->mu);
        b->next = NULL;
        if (b->len) {
            if (t->ready_tail)
                t->ready_tail->next = b;
            else
                t->ready_head = b;
            t->ready_tail = b;
        } else {
            b->next = t->spare;
            t->spare = b;
        }
        pthread_cond_signal(&t->to_decoder);
        pthread_mutex_unlock(&t->mu);
        if (st)
            break;
    }
    pthread_mutex_lock(&t->mu);
    t->finished = true;
    t->status = st;
    if (st)
        snprintf(t->message, sizeof(t->message), "%s", cca_last_error()->message);
    pthread_cond_signal(&t->to_decoder);
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

static void blocks_free(tblock_t *b)
{
    while (b) {
        tblock_t *next = b->next;
        free(b);
        b = next;
    }
}

static cca_status_t inflater_start(pk_input_t *in)
{
    struct inflater *t = calloc(1, sizeof(*t));
    if (!t)
        return in_oom();
    /* every block made here, by the decoding thread: the inflating one allocates nothing
     * (a thread's first allocation gives it a malloc heap of its own; on a 16-core host,
     * loads after the first in one process ran up to 40% slower unless the process kept
     * one heap) */
    for (size_t i = 0; i < TBLOCKS; i++) {
        tblock_t *b = malloc(sizeof(*b));
        if (!b)
            break;
        b->next = t->spare;
        t->spare = b;
    }
    if (!t->spare || pthread_mutex_init(&t->mu, NULL)) {
        blocks_free(t->spare);
        free(t);
        return CCA_OK; /* no thread: the decoder inflates itself */
    }
    if (pthread_cond_init(&t->to_decoder, NULL))
        goto out_mu;
    if (pthread_cond_init(&t->to_inflater, NULL))
        goto out_cv;
    in->inf = t;
    if (pthread_create(&t->thread, NULL, inflater_main, in) == 0)
        return CCA_OK;
    in->inf = NULL;
    pthread_cond_destroy(&t->to_inflater);
out_cv:
    pthread_cond_destroy(&t->to_decoder);
out_mu:
    pthread_mutex_destroy(&t->mu);
    blocks_free(t->spare);
    free(t);
    return CCA_OK; /* no thread: the decoder inflates itself */
}

static void inflater_stop(pk_input_t *in)
{
    struct inflater *t = in->inf;
    if (!t)
        return;
    pthread_mutex_lock(&t->mu);
    t->cancel = true;
    pthread_cond_signal(&t->to_inflater);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->thread, NULL);
    blocks_free(t->ready_head);
    blocks_free(t->spare);
    pthread_cond_destroy(&t->to_inflater);
    pthread_cond_destroy(&t->to_decoder);
    pthread_mutex_destroy(&t->mu);
    free(t);
    in->inf = NULL;
}

/* The next inflated block, in order (waits for it); NULL at the end of the data
 * (in->eof set) or on the thread's error (*st raised). */
static tblock_t *next_block(pk_input_t *in, cca_status_t *st)
{
    struct inflater *t = in->inf;
    *st = CCA_OK;
    pthread_mutex_lock(&t->mu);
    while (!t->ready_head && !t->finished)
        pthread_cond_wait(&t->to_decoder, &t->mu);
    tblock_t *b = t->ready_head;
    if (b) {
        t->ready_head = b->next;
        if (!t->ready_head)
            t->ready_tail = NULL;
    }
    /* the thread's status counts only once every block it made was taken */
    cca_status_t status = b ? CCA_OK : t->status;
    pthread_mutex_unlock(&t->mu);
    if (!b) {
        if (status)
            *st = cca_raise(status, "%s", t->message);
        else
            in->eof = true;
    }
    return b;
}

/* Hand a block back to the inflating thread. */
static void release_block(pk_input_t *in, tblock_t *b)
{
    struct inflater *t = in->inf;
    if (!b)
        return;
    pthread_mutex_lock(&t->mu);
    b->next = t->spare;
    t->spare = b;
    pthread_cond_signal(&t->to_inflater);
    pthread_mutex_unlock(&t->mu);
}

/*
 * pk_input_fill when inflating on a second thread: the window becomes the next
 * block itself, its unread tail copied into the room before the block's data,
 * whenever that holds `need` bytes; otherwise the bytes gather in the window's
 * own buffer.
 */
static cca_status_t fill_from_blocks(pk_input_t *in, size_t need)
{
    cca_status_t st = CCA_OK;
    while (in->end - in->pos < need && !in->eof) {
        tblock_t *b = next_block(in, &st);
        if (!b)
            return st;
        size_t tail = in->end - in->pos, len = b->len; /* b is the thread's again once released */
        if (tail <= TBLOCK_HEAD && tail + len >= need) {
            if (tail)
                memcpy(b->data - tail, in->buf + in->pos, tail);
            release_block(in, in->held);
            in->held = b;
            in->buf = b->data - tail;
            in->cap = tail + len;
        } else {
            size_t want = tail + len;
            if (want > in->own_cap) {
                size_t cap = want > need + PK_WINDOW_DEFAULT ? want : need + PK_WINDOW_DEFAULT;
                uint8_t *own = malloc(cap);
                if (!own) {
                    release_block(in, b);
                    return in_oom();
                }
                if (tail)
                    memcpy(own, in->buf + in->pos, tail);
                free(in->own);
                in->own = own;
                in->own_cap = cap;
            } else if (tail) {
                memmove(in->own, in->buf + in->pos, tail);
            }
            memcpy(in->own + tail, b->data, len);
            release_block(in, b);
            release_block(in, in->held);
            in->held = NULL;
            in->buf = in->own;
            in->cap = in->own_cap;
        }
        in->base += in->pos;
        in->pos = 0;
        in->end = tail + len;
    }
    return CCA_OK;
}

cca_status_t pk_input_fill(pk_input_t *in, size_t need)
{
    if (in->inf)
        return fill_from_blocks(in, need);
    if (in->pos) {
        memmove(in->buf, in->buf + in->pos, in->end - in->pos);
        in->end -= in->pos;
        in->base += in->pos;
        in->pos = 0;
    }
    size_t target = need + in->chunk;
    if (target > in->cap) {
        uint8_t *b = realloc(in->buf, target);
        if (!b)
            return in_oom();
        in->buf = in->own = b;
        in->cap = in->own_cap = target;
    }
    while (in->end < need && !in->eof) {
        size_t room = in->cap - in->end;
        if (room > in->chunk)
            room = in->chunk;
        if (in->gz) {
            size_t made = 0;
            cca_status_t st = inflate_into(in, in->buf + in->end, room, &made, &in->eof);
            in->end += made;
            if (st)
                return st;
        } else {
            size_t got = 0;
            cca_status_t st = source_read(in, in->buf + in->end, room, &got);
            if (st)
                return st;
            in->end += got;
            if (!got)
                in->eof = true;
        }
    }
    return CCA_OK;
}


/*
 * After STOP: read a gzip source to its end, so that its integrity (deflate
 * data and CRC) is checked as the tree reader checks it; the bytes after the
 * pickle are ignored, as Python's pickle.loads ignores them.
 */
cca_status_t pk_input_drain(pk_input_t *in)
{
    cca_status_t st = CCA_OK;
    while (in->gz && !in->eof && st == CCA_OK) {
        in->base += in->end;
        in->pos = in->end = 0;
        if (in->inf) {
            release_block(in, next_block(in, &st)); /* checked by the thread; dropped */
            continue;
        }
        if (!in->cap && !(in->buf = in->own = malloc(in->cap = in->own_cap = PK_WINDOW_DEFAULT)))
            return in_oom();
        size_t made = 0;
        st = inflate_into(in, in->buf, in->cap, &made, &in->eof);
        in->end = made;
    }
    return st;
}

cca_status_t pk_input_start(pk_input_t *in)
{
    if (!in->chunk)
        in->chunk = PK_WINDOW_DEFAULT; /* and a gzip source is inflated on a second thread */
    /* sniff the gzip magic */
    uint8_t head[2];
    size_t got = 0;
    cca_status_t st = source_read(in, head, 2, &got);
    if (st)
        return st;
    if (got == 2 && head[0] == 0x1f && head[1] == 0x8b) {
        in->gz = true;
        in->zin = malloc(IN_CHUNK);
        if (!in->zin)
            return in_oom();
        if (inflateInit2(&in->zs, 15 + 32) != Z_OK)
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "pickle: cannot initialise zlib");
        in->zs_live = true;
        inflateValidate(&in->zs, 0); /* the CRC is checked here, faster (pk_crc32) */
        memcpy(in->zin, head, 2);
        in->zs.next_in = in->zin;
        in->zs.avail_in = 2;
        in->gz_in_total = in->src_left + 2;
        if (in->chunk == PK_WINDOW_DEFAULT)
            return inflater_start(in);
        return CCA_OK;
    }
    in->cap = in->own_cap = in->chunk + PK_INPUT_SLACK;
    in->buf = in->own = malloc(in->cap);
    if (!in->buf)
        return in_oom();
    memcpy(in->buf, head, got);
    in->end = got;
    in->eof = got < 2;
    return CCA_OK;
}

void pk_input_close(pk_input_t *in)
{
    if (in->inf)
        release_block(in, in->held);
    in->held = NULL;
    inflater_stop(in);
    if (in->zs_live)
        inflateEnd(&in->zs);
    in->zs_live = false;
    free(in->zin);
    free(in->own);
    in->zin = NULL;
    in->buf = in->own = NULL;
}
