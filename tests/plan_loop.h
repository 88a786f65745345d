/*
 * plan_loop.h - a loop of large requests repeated every step, for the tests of
 * compact_memory's planned placement: n sizes and lifetimes drawn once from a
 * seed (a tenth of the sizes 300 to 800 MiB, the rest 6 to 192 MiB, each plus
 * 0 to 1.5 MiB), every block freed by the step's end, so the loop has a quiet
 * phase as a training step has. With compact_memory at its limit's cap, best
 * fit keeps moving granules at every step for most seeds (seed 4, 48
 * requests: 53 maps in steps 15 to 29); divide scales the sizes down.
 */
#ifndef CCA_TEST_PLAN_LOOP_H
#define CCA_TEST_PLAN_LOOP_H

#include <stdint.h>
#include <string.h>

#include "cca.h"

#define PLAN_LOOP_MAX 64

typedef struct plan_loop {
    int n;
    size_t size[PLAN_LOOP_MAX];
    long life[PLAN_LOOP_MAX];
    void *live[2 * PLAN_LOOP_MAX];
    long dies[2 * PLAN_LOOP_MAX];
    long t; /* requests made */
    cca_stream_t stream;
} plan_loop_t;

static inline uint32_t plan_loop_draw(uint64_t *rng)
{
    *rng = *rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(*rng >> 33);
}

static inline void plan_loop_init(plan_loop_t *l, unsigned seed, int n, size_t divide, cca_stream_t stream)
{
    static const size_t sizes[] = {6, 12, 24, 48, 96, 192};
    uint64_t rng = (uint64_t)seed * 7919 + 17;
    memset(l, 0, sizeof(*l));
    l->n = n < PLAN_LOOP_MAX ? n : PLAN_LOOP_MAX;
    l->stream = stream;
    for (int k = 0; k < l->n; k++) {
        size_t mib = plan_loop_draw(&rng) % 10 == 0 ? 300 + plan_loop_draw(&rng) % 500
                                                    : sizes[plan_loop_draw(&rng) % 6];
        l->size[k] = (mib * ((size_t)1 << 20) + (plan_loop_draw(&rng) % 4) * 512 * 1024) / divide;
        uint32_t span = plan_loop_draw(&rng) % 3 == 0 ? (uint32_t)l->n : (uint32_t)l->n / 4 + 1;
        l->life[k] = 1 + (long)(plan_loop_draw(&rng) % span);
        if (l->life[k] > l->n - k)
            l->life[k] = l->n - k;
    }
}

/* One step: each request after the frees its time has come for. The first failure is
 * returned, the step going on (its block missing). */
static inline cca_status_t plan_loop_step(plan_loop_t *l)
{
    cca_status_t first = CCA_OK;
    for (int j = 0; j < l->n; j++, l->t++) {
        for (int s = 0; s < 2 * l->n; s++)
            if (l->live[s] && l->dies[s] <= l->t) {
                cca_free(l->live[s]);
                l->live[s] = NULL;
            }
        int slot = (int)(l->t % (2 * l->n));
        cca_status_t st = cca_malloc(&l->live[slot], l->size[j], l->stream);
        if (st != CCA_OK) {
            l->live[slot] = NULL;
            if (first == CCA_OK)
                first = st;
        }
        l->dies[slot] = l->t + l->life[j];
    }
    return first;
}

/* Free what is live. */
static inline void plan_loop_end(plan_loop_t *l)
{
    for (int s = 0; s < 2 * l->n; s++)
        if (l->live[s]) {
            cca_free(l->live[s]);
            l->live[s] = NULL;
        }
}

#endif
