/*
 * util.c - small helpers: a growable string buffer (plain malloc, never the
 * allocator being described), a zero-filled array that grows without
 * copying, byte-size parsing, clocks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#include "internal.h"

void sb_init(cca_strbuf_t *sb)
{
    memset(sb, 0, sizeof(*sb));
}

void sb_free(cca_strbuf_t *sb)
{
    free(sb->data);
    memset(sb, 0, sizeof(*sb));
}

static bool sb_reserve(cca_strbuf_t *sb, size_t extra)
{
    if (sb->failed)
        return false;
    if (sb->len + extra + 1 <= sb->cap)
        return true;
    size_t cap = sb->cap ? sb->cap : 256;
    while (cap < sb->len + extra + 1)
        cap *= 2;
    char *data = realloc(sb->data, cap);
    if (!data) {
        sb->failed = true;
        return false;
    }
    sb->data = data;
    sb->cap = cap;
    return true;
}

void sb_appendn(cca_strbuf_t *sb, const char *text, size_t n)
{
    if (!sb_reserve(sb, n))
        return;
    memcpy(sb->data + sb->len, text, n);
    sb->len += n;
    sb->data[sb->len] = '\0';
}

void sb_append(cca_strbuf_t *sb, const char *text)
{
    sb_appendn(sb, text, strlen(text));
}

void sb_printf(cca_strbuf_t *sb, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || !sb_reserve(sb, (size_t)n))
        return;
    va_start(ap, fmt);
    vsnprintf(sb->data + sb->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    sb->len += (size_t)n;
}

void sb_json_string(cca_strbuf_t *sb, const char *text)
{
    sb_append(sb, "\"");
    for (const unsigned char *p = (const unsigned char *)text; *p; p++) {
        switch (*p) {
        case '"': sb_append(sb, "\\\""); break;
        case '\\': sb_append(sb, "\\\\"); break;
        case '\n': sb_append(sb, "\\n"); break;
        case '\r': sb_append(sb, "\\r"); break;
        case '\t': sb_append(sb, "\\t"); break;
        default:
            if (*p < 0x20)
                sb_printf(sb, "\\u%04x", *p);
            else
                sb_appendn(sb, (const char *)p, 1);
        }
    }
    sb_append(sb, "\"");
}

bool cca_parse_bytes(const char *text, size_t *bytes)
{
    if (!text || !*text)
        return false;
    char *end = NULL;
    unsigned long long v = strtoull(text, &end, 10);
    if (end == text || text[0] == '-')
        return false;
    unsigned shift = 0;
    switch (*end) {
    case '\0': break;
    case 'k': case 'K': shift = 10; end++; break;
    case 'm': case 'M': shift = 20; end++; break;
    case 'g': case 'G': shift = 30; end++; break;
    case 't': case 'T': shift = 40; end++; break;
    default: return false;
    }
    if (*end == 'i' && shift) end++;
    if ((*end == 'B' || *end == 'b') && end[1] == '\0') end++;
    if (*end != '\0')
        return false;
    if (shift && v > (SIZE_MAX >> shift))
        return false;
    *bytes = (size_t)(v << shift);
    return true;
}

uint64_t cca_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int64_t cca_wall_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* ---- zero-filled arrays -------------------------------------------------------- */

#ifdef __linux__
#define ZA_PAGE ((size_t)4096)

static size_t za_round(size_t n)
{
    return (n + ZA_PAGE - 1) & ~(ZA_PAGE - 1);
}

bool cca_zarray_grow(void **data, size_t *bytes, size_t need)
{
    if (need <= *bytes)
        return true;
    size_t n = *bytes ? *bytes : 16 * ZA_PAGE;
    while (n < need) {
        if (n > SIZE_MAX / 2)
            return false;
        n *= 2;
    }
    n = za_round(n);
    void *p;
    if (!*data)
        p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    else
        p = mremap(*data, *bytes, n, MREMAP_MAYMOVE);
    if (p == MAP_FAILED)
        return false;
    *data = p;
    *bytes = n;
    return true;
}

void cca_zarray_free(void *data, size_t bytes)
{
    if (data)
        munmap(data, bytes);
}
#else
bool cca_zarray_grow(void **data, size_t *bytes, size_t need)
{
    if (need <= *bytes)
        return true;
    size_t n = *bytes ? *bytes : 65536;
    while (n < need) {
        if (n > SIZE_MAX / 2)
            return false;
        n *= 2;
    }
    void *p = realloc(*data, n);
    if (!p)
        return false;
    memset((char *)p + *bytes, 0, n - *bytes);
    *data = p;
    *bytes = n;
    return true;
}

void cca_zarray_free(void *data, size_t bytes)
{
    (void)bytes;
    free(data);
}
#endif
