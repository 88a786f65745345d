/*
 * plan.h - compact_memory's planned placement (plan.c): a loop whose large
 * requests repeat, and whose growths keep moving granules, is given a
 * placement computed from one period of its requests (sizes and lifetimes),
 * served in a range of address space of its own, mapped once.
 *
 * Included by device_types.h after cca_pool_t and cca_block_t.
 */
#ifndef CCA_PLAN_H
#define CCA_PLAN_H

typedef struct cca_plan cca_plan_t;

/*
 * The placement, if planned, of the large request of rsize bytes about to
 * be made from pool (a default pool's large pool, compact_memory on; sp's
 * lock held on entry and on return, the device lock not held). CCA_OK with
 * *out set: the block is handed out (statistics, pointer map) at its
 * planned address; *out NULL: not placed (no plan, another size, or the
 * place not free), the caller goes on as usual. Mapping the place's
 * granules takes the device lock (sp's lock released meanwhile).
 */
cca_status_t plan_place(cca_device_t *dev, cca_pool_t *pool, size_t rsize, size_t size, cca_block_t **out);

/* Note a large allocation of pool (compact_memory on), planned or not (sp's lock held): its
 * rounded size rsize goes into the record the period is found from; the block is tagged for its free. */
void plan_note_alloc(cca_device_t *dev, cca_pool_t *pool, cca_block_t *block, size_t rsize);

/* A growth of pool moved granules (its lock held): what decides whether its loop is planned. */
void plan_note_moved(cca_pool_t *pool);

/* Add the pool's plans made, requests placed by them and requests that missed their place
 * (its lock held). */
void plan_count(const cca_pool_t *pool, uint64_t *plans, uint64_t *placed, uint64_t *missed);

/* Note the program's free of a tagged block (plan_serial != 0; its pool's lock held). */
void plan_note_free(cca_block_t *block);

/* Forget the record and the plan (cca_empty_cache: a new phase; its pool's lock held). */
void plan_reset(cca_pool_t *pool);

/* Free the pool's plan state (the pool goes away). */
void plan_delete(cca_pool_t *pool);

/* The segment seg of pool is released: a plan whose range it holds is dropped (its pool's
 * lock held). */
void plan_segment_gone(cca_pool_t *pool, const cca_segment_t *seg);

/* The address range of pool's active plan in seg, if any: a growth lends no granule of it
 * (its pool's lock held). */
bool plan_range(const cca_pool_t *pool, const cca_segment_t *seg, uintptr_t *lo, uintptr_t *hi);

/* Tests: with off, no plan is made (the loop goes by best fit: the control). */
void plan_test_off(bool off);
/* Tests: with on, a loop is planned whether its growths moved granules or not (a threaded
 * test plans every thread's loop). */
void plan_test_force(bool on);

#endif
