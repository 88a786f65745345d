/*
 * expandable.h - what expandable.c (expandable segments: reservations,
 * granules mapped and unmapped) and compact.c (compact_memory: free granules
 * moved to where growth needs them) give each other. Nothing else includes
 * it: the rest of the library calls both through device.h.
 *
 * Everything here runs with the device lock and the segment's stream pool
 * lock held.
 */
#ifndef CCA_EXPANDABLE_H
#define CCA_EXPANDABLE_H

#include "device.h"

/* ---- expandable.c ------------------------------------------------------------------- */

/* Granule index of addr in seg, rounded down or up; the address of granule i. */
static inline size_t expandable_granule_floor(const cca_segment_t *seg, uintptr_t addr)
{
    return (addr - seg->base) / seg->es->granule;
}

static inline size_t expandable_granule_ceil(const cca_segment_t *seg, uintptr_t addr)
{
    size_t g = seg->es->granule;
    return (addr - seg->base + g - 1) / g;
}

static inline uintptr_t expandable_granule_addr(const cca_segment_t *seg, size_t i)
{
    return seg->base + i * seg->es->granule;
}

/* The unmapped list of a pool (by address): insert, remove. */
void expandable_unmapped_insert(cca_pool_t *pool, cca_block_t *b);
void expandable_unmapped_remove(cca_pool_t *pool, cca_block_t *b);
/* Merge the unmapped neighbour src into the unmapped block dst. */
void expandable_merge_unmapped(cca_pool_t *pool, cca_block_t *dst, cca_block_t *src);
/* Link b into its segment's block list between before and after. */
void expandable_splice(cca_block_t *b, cca_block_t *before, cca_block_t *after);
/* PyTorch's "allocatable": free, no events, no recorded streams; never an aliased block. */
bool expandable_allocatable(const cca_block_t *b);

/* Room for more orphan records (false: out of host memory); keep a granule to unmap (if
 * mapped) and release later. */
bool expandable_orphans_reserve(cca_device_t *dev, size_t more);
void expandable_orphan_push(cca_device_t *dev, uintptr_t addr, size_t size, cca_phys_handle_t handle,
                            bool mapped);
/* Room for more lent handles in dev->lent, and for their orphan records. */
bool expandable_lent_reserve(cca_device_t *dev, size_t more);

/* Reserve a new expandable segment for pool; its one (unmapped) block in *out. */
cca_status_t expandable_segment_create(cca_device_t *dev, cca_pool_t *pool, cca_block_t **out);
/* Free a segment whose only block is unmapped. */
cca_status_t expandable_segment_release(cca_device_t *dev, cca_block_t *block);
/* PyTorch's find_expandable_block: where a growth of size bytes starts (else a new segment). */
cca_status_t expandable_find_block(cca_device_t *dev, cca_pool_t *pool, size_t size, cca_block_t **out);
/* Granules a growth from c maps for size bytes. */
size_t expandable_granules_needed(const cca_block_t *c, size_t size);
/* PyTorch's map_block: map the first size bytes of the unmapped block to_map, merged with its
 * free neighbours and binned in *out (handles lent to the growth first). */
cca_status_t expandable_map_block(cca_device_t *dev, cca_block_t *to_map, size_t size, cca_block_t **out);
/* Unmap granules [begin, end) of a free block (lend: their handles into dev->lent); *released
 * when its reservation went with them. */
cca_status_t expandable_unmap_granules(cca_device_t *dev, cca_block_t *block, size_t begin, size_t end,
                                       bool lend, bool *released);
/* The allocator's half of unmapping granules [begin, stop) of a free block: the parts that stay
 * mapped split off (before, after: spare structs), the unmap accounted. */
void expandable_take_out(cca_device_t *dev, cca_block_t *block, size_t begin, size_t stop,
                         cca_block_t *before, cca_block_t *after);
/* Wait for a stream's work (the device's, for a stream the program destroyed). */
cca_status_t expandable_wait_stream(cca_device_t *dev, cca_stream_t stream);

/* ---- compact.c ---------------------------------------------------------------------- */

/* Before a growth from *c maps new memory: free granules elsewhere lent to it (dev->lent),
 * *c found again, the move counted (and told to the plan at the limit's cap). */
cca_status_t compact_prepare(cca_device_t *dev, cca_pool_t *pool, size_t size, cca_block_t **c);
/* Count the move of the granules lent to the growth under way, if any; true if there were. */
bool compact_count_moves(cca_device_t *dev);
/* Give back the handles lent and not used (settle: after the aliases' old mappings). */
void compact_lent_release(cca_device_t *dev, cca_stream_pool_t *held, bool settle);
/* Whether the handle h is still mapped at an aliased block's old address. */
bool compact_handle_aliased(const cca_device_t *dev, cca_phys_handle_t h);
/* The stream of owner has been waited for: every block returned to it is ready, and the old
 * mappings of its aliased blocks are unmapped. */
void compact_stream_done(cca_device_t *dev, cca_stream_pool_t *owner);

#endif /* CCA_EXPANDABLE_H */
