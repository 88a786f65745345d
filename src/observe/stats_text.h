/*
 * stats_text.h - one statistic's update rules (PyTorch's Stat) and the text
 * of a device's statistics: the flat memory_stats key list, the
 * memory_summary table, format_size. Plain data in, text out: no allocator
 * knowledge (the device allocator hands its cca_device_stats_t over).
 */
#ifndef CCA_STATS_TEXT_H
#define CCA_STATS_TEXT_H

#include "internal.h"

/* PyTorch's Stat update rules: a rise (peak followed, allocated counted) and a fall. */
static inline void stat_increase(cca_stat_t *stat, int64_t amount)
{
    stat->current += amount;
    if (stat->current > stat->peak)
        stat->peak = stat->current;
    stat->allocated += amount;
}

static inline void stat_decrease(cca_stat_t *stat, int64_t amount)
{
    stat->current -= amount;
    stat->freed += amount;
}

/* Append the memory_summary text for stats. */
void stats_format_summary(const cca_device_stats_t *stats, int device, bool abbreviated,
                          cca_strbuf_t *out);
/* Fill PyTorch's flat memory_stats list (sorted keys). */
void stats_flatten(const cca_device_stats_t *stats, cca_stat_entry_t *out);
/*
 * The per-operation statistics (those a stream pool keeps when peaks are
 * sampled): the CCA_OP_STAT_ARRAYS arrays of *stats, in a fixed order, plus
 * oversize_allocations, which the caller handles by name.
 */
#define CCA_OP_STAT_ARRAYS 7
void stats_op_arrays(cca_device_stats_t *stats, cca_stat_t *out[CCA_OP_STAT_ARRAYS]);
/* PyTorch's format_size (used in the OOM message). */
void stats_format_size(size_t size, char *buf, size_t buflen);

#endif /* CCA_STATS_TEXT_H */
