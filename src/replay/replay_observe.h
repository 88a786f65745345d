/*
 * replay_observe.h - a hook into the replay loop for what watches a replay
 * event by event (replay_explain.c): told of every allocation cca placed and
 * called after every trace event, with cca up and nothing locked, so it may
 * call cca (e.g. cca_snapshot). A replay with an observer runs after the
 * reading (never on a second thread).
 */
#ifndef CCA_REPLAY_OBSERVE_H
#define CCA_REPLAY_OBSERVE_H

#include <stddef.h>
#include <stdint.h>

#include "cca.h"

typedef struct replay_observer {
    void *ctx;
    /* trace event `index` (an alloc) was placed at cca's pointer ptr */
    void (*on_alloc)(void *ctx, size_t index, uint64_t ptr);
    /* trace event `index` was replayed; false stops the replay with the error it raised */
    bool (*after_event)(void *ctx, size_t index);
} replay_observer_t;

/* cca_replay_file with an observer (NULL: none). Same statuses. */
cca_status_t replay_file_observed(const char *path, const cca_replay_options_t *options,
                                  const replay_observer_t *observer, cca_replay_result_t *result);

#endif /* CCA_REPLAY_OBSERVE_H */
