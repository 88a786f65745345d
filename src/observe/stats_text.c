/*
 * stats.c - statistics: the update rules of PyTorch's Stat, the flat
 * memory_stats() key list and the memory_summary() text, all generated from
 * one list of fields so the three never disagree.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stats_text.h"

/* The per-pool statistics, in PyTorch's naming: X(field, key, summary title, kind). */
#define CCA_ARRAY_STATS(X)                                                   \
    X(allocated_bytes, "allocated_bytes", "Allocated memory", 1)             \
    X(active_bytes, "active_bytes", "Active memory", 1)                      \
    X(requested_bytes, "requested_bytes", "Requested memory", 1)             \
    X(reserved_bytes, "reserved_bytes", "GPU reserved memory", 1)            \
    X(inactive_split_bytes, "inactive_split_bytes", "Non-releasable memory", 1) \
    X(allocation, "allocation", "Allocations", 0)                            \
    X(active, "active", "Active allocs", 0)                                  \
    X(segment, "segment", "GPU reserved segments", 0)                        \
    X(inactive_split, "inactive_split", "Non-releasable allocs", 0)

#define CCA_SINGLE_STATS(X)                                                  \
    X(oversize_allocations, "oversize_allocations", "Oversize allocations", 0) \
    X(oversize_segments, "oversize_segments", "Oversize GPU segments", 0)

#define CCA_COUNTERS(X)                                                      \
    X(num_alloc_retries, "num_alloc_retries")                                \
    X(num_ooms, "num_ooms")                                                  \
    X(num_sync_all_streams, "num_sync_all_streams")                          \
    X(num_device_alloc, "num_device_alloc")                                  \
    X(num_device_free, "num_device_free")                                    \
    X(max_split_size, "max_split_size")

void stats_op_arrays(cca_device_stats_t *stats, cca_stat_t *out[CCA_OP_STAT_ARRAYS])
{
    out[0] = stats->allocation;
    out[1] = stats->allocated_bytes;
    out[2] = stats->active;
    out[3] = stats->active_bytes;
    out[4] = stats->requested_bytes;
    out[5] = stats->inactive_split;
    out[6] = stats->inactive_split_bytes;
}

static const char *const pool_names[CCA_STAT_TYPES] = {"all", "small_pool", "large_pool"};

/* Static key strings: "<name>.<pool>.<field>" for every combination. */
#define KEY4(name, part)                                                     \
    {name "." part ".current", name "." part ".peak", name "." part ".allocated", name "." part ".freed"}
#define KEYS_ARRAY(field, key, title, kind)                                  \
    static const char *const keys_##field[CCA_STAT_TYPES][4] = {             \
        KEY4(key, "all"), KEY4(key, "small_pool"), KEY4(key, "large_pool")};
CCA_ARRAY_STATS(KEYS_ARRAY)
#define KEYS_SINGLE(field, key, title, kind)                                 \
    static const char *const keys_##field[4] = {key ".current", key ".peak", key ".allocated", key ".freed"};
CCA_SINGLE_STATS(KEYS_SINGLE)

static int entry_cmp(const void *a, const void *b)
{
    return strcmp(((const cca_stat_entry_t *)a)->key, ((const cca_stat_entry_t *)b)->key);
}

static size_t put_stat(cca_stat_entry_t *out, size_t n, const char *const keys[4], const cca_stat_t *s)
{
    out[n++] = (cca_stat_entry_t){keys[0], s->current};
    out[n++] = (cca_stat_entry_t){keys[1], s->peak};
    out[n++] = (cca_stat_entry_t){keys[2], s->allocated};
    out[n++] = (cca_stat_entry_t){keys[3], s->freed};
    return n;
}

void stats_flatten(const cca_device_stats_t *stats, cca_stat_entry_t *out)
{
    size_t n = 0;
#define FLAT_ARRAY(field, key, title, kind)                                  \
    for (int t = 0; t < CCA_STAT_TYPES; t++)                                 \
        n = put_stat(out, n, keys_##field[t], &stats->field[t]);
    CCA_ARRAY_STATS(FLAT_ARRAY)
#define FLAT_SINGLE(field, key, title, kind) n = put_stat(out, n, keys_##field, &stats->field);
    CCA_SINGLE_STATS(FLAT_SINGLE)
#define FLAT_COUNTER(field, key) out[n++] = (cca_stat_entry_t){key, stats->field};
    CCA_COUNTERS(FLAT_COUNTER)
    qsort(out, n, sizeof(*out), entry_cmp);
}

void stats_format_size(size_t size, char *buf, size_t buflen)
{
    if (size <= 1024)
        snprintf(buf, buflen, "%zu bytes", size);
    else if (size <= 1048576)
        snprintf(buf, buflen, "%.2f KiB", (double)size / 1024.0);
    else if (size <= 1073741824ull)
        snprintf(buf, buflen, "%.2f MiB", (double)size / 1048576.0);
    else
        snprintf(buf, buflen, "%.2f GiB", (double)size / 1073741824.0);
}

/* memory_summary's _format_size: the unit is chosen by pref (the "all" row). */
static void summary_size(cca_strbuf_t *out, int64_t sz, int64_t pref)
{
    static const char *const prefixes[] = {"B  ", "KiB", "MiB", "GiB", "TiB", "PiB"};
    const char *prefix = prefixes[0];
    double pref_sz = (double)pref;
    for (int i = 1; i < 6; i++) {
        if (pref_sz < 768 * 1024)
            break;
        prefix = prefixes[i];
        sz = sz >= 0 ? sz / 1024 : -((-sz + 1023) / 1024); /* Python floor division */
        pref_sz /= 1024;
    }
    sb_printf(out, "%6lld %s", (long long)sz, prefix);
}

static void summary_count(cca_strbuf_t *out, int64_t cnt, int64_t pref)
{
    static const char *const prefixes[] = {" ", "K", "M"};
    const char *prefix = prefixes[0];
    double pref_cnt = (double)pref;
    for (int i = 1; i < 3; i++) {
        if (pref_cnt < 750 * 1000)
            break;
        prefix = prefixes[i];
        cnt = cnt >= 0 ? cnt / 1000 : -((-cnt + 999) / 1000);
        pref_cnt /= 1000;
    }
    sb_printf(out, "%7lld %s ", (long long)cnt, prefix);
}

static void summary_row(cca_strbuf_t *out, const char *name, const cca_stat_t *s,
                        const cca_stat_t *pref, int kind)
{
    void (*fmt)(cca_strbuf_t *, int64_t, int64_t) = kind ? summary_size : summary_count;
    sb_printf(out, "| %-21s | ", name);
    fmt(out, s->current, pref->current);
    sb_append(out, " | ");
    fmt(out, s->peak, pref->peak);
    sb_append(out, " | ");
    fmt(out, s->allocated, pref->allocated);
    sb_append(out, " | ");
    fmt(out, s->freed, pref->freed);
    sb_append(out, " |\n");
}

#define RULE_EQ "|===========================================================================|\n"
#define RULE_DASH "|---------------------------------------------------------------------------|\n"

void stats_format_summary(const cca_device_stats_t *stats, int device, bool abbreviated,
                          cca_strbuf_t *out)
{
    sb_append(out, RULE_EQ);
    sb_printf(out, "| %16s cca CUDA memory summary, device ID %-21d |\n", "", device);
    sb_append(out, RULE_DASH);
    sb_printf(out, "|  %9s CUDA OOMs: %-12lld | %6s cudaMalloc retries: %-8lld  |\n", "",
              (long long)stats->num_ooms, "", (long long)stats->num_alloc_retries);
    sb_append(out, RULE_EQ);
    sb_append(out, "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |\n");
#define SUMMARY_ARRAY(field, key, title, kind)                               \
    sb_append(out, RULE_DASH);                                               \
    summary_row(out, title, &stats->field[CCA_STAT_ALL], &stats->field[CCA_STAT_ALL], kind); \
    if (!abbreviated) {                                                      \
        summary_row(out, "      from large pool", &stats->field[CCA_STAT_LARGE_POOL], \
                    &stats->field[CCA_STAT_ALL], kind);                      \
        summary_row(out, "      from small pool", &stats->field[CCA_STAT_SMALL_POOL], \
                    &stats->field[CCA_STAT_ALL], kind);                      \
    }
    CCA_ARRAY_STATS(SUMMARY_ARRAY)
#define SUMMARY_SINGLE(field, key, title, kind)                              \
    sb_append(out, RULE_DASH);                                               \
    summary_row(out, title, &stats->field, &stats->field, kind);
    CCA_SINGLE_STATS(SUMMARY_SINGLE)
    sb_append(out, RULE_EQ);
    (void)pool_names;
}
