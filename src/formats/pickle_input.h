/*
 * pickle_input.h - the input window of the streaming pickle reader
 * (pickle_input.c): decompressed bytes from a file or from memory, gunzipped
 * on the fly, handed to the decoder a window at a time.
 */
#ifndef CCA_PICKLE_INPUT_H
#define CCA_PICKLE_INPUT_H

#include <stdio.h>
#include <zlib.h>

#include "internal.h"

#define PK_WINDOW_DEFAULT ((size_t)256 * 1024) /* bytes added per refill */
#define PK_INPUT_SLACK 16                       /* bytes of room past a refill's target */

typedef struct pk_input {
    /* the window: buf[pos .. end) are the next bytes, at offset base + pos of the data;
     * buf is own (cap bytes), or, when inflating on a second thread, an inflated block
     * itself (held) whenever the bytes fit in one: those are decoded where inflated */
    uint8_t *buf;
    size_t cap, pos, end;
    uint8_t *own;            /* the window's own buffer, own_cap bytes */
    size_t own_cap;
    struct tblock *held;     /* the block buf points into, NULL when buf is own */
    uint64_t base;
    bool eof;                /* nothing more will come */
    size_t want;             /* the decoder needs this many bytes from pos (0: none) */

    /* the source: set file, or mem and mem_size; src_left to its size; chunk (0: default) */
    FILE *file;
    const uint8_t *mem;
    size_t mem_size, mem_pos;
    size_t chunk;            /* bytes per refill (tests cut the input with small ones) */
    uint64_t src_left;       /* compressed (or raw) bytes not yet read from the source */
    bool gz, zs_live, z_end;
    z_stream zs;
    uint8_t *zin;            /* compressed input for inflate */
    uint64_t gz_in_total;    /* compressed bytes in all */
    struct inflater *inf;    /* the inflating thread, NULL when inflating in the caller */
    uint32_t gz_crc;         /* CRC-32 of the current member's output so far */
    uint64_t gz_out;         /* bytes of the current member's output so far */
    uint8_t gz_tail[8];      /* the last 8 compressed bytes consumed */
} pk_input_t;

/* zlib's crc32 (same values, crc32(0, NULL, 0) == 0 start), faster on x86-64 with PCLMULQDQ. */
uint32_t pk_crc32(uint32_t crc, const void *data, size_t len);

/*
 * Start reading: detect gzip, start the inflating thread (gzip at the default
 * window; without a thread the caller inflates). Returns CCA_OK, CCA_ERR_IO,
 * CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t pk_input_start(pk_input_t *in);
/*
 * Make at least need bytes available from pos (moving the tail to the front),
 * unless the data ends first. Returns CCA_OK, CCA_ERR_IO, CCA_ERR_FORMAT
 * (corrupt or truncated gzip), CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t pk_input_fill(pk_input_t *in, size_t need);
/* An upper bound of the decompressed bytes after the window's end. */
uint64_t pk_input_left_bound(const pk_input_t *in);
/*
 * After the pickle's STOP: read a gzip source to its end, so that its
 * integrity (deflate data and CRC) is checked; the bytes are ignored. Returns
 * as pk_input_fill.
 */
cca_status_t pk_input_drain(pk_input_t *in);
/* Stop the thread and free the window (the file is the caller's). */
void pk_input_close(pk_input_t *in);

#endif /* CCA_PICKLE_INPUT_H */
