/*
 * fuzz_replay.c - fuzz target for `cca_replay_file` both ways: the input is
 * written to a file and replayed once after reading it (`sequential`) and
 * once on a second thread while reading it (the default). Both must return the
 * same status with the same message, and on success the same result field by
 * field (replay_compare.h); cca must be shut down after each. A third replay
 * (sequential) has the inference undo every event rather than decide from the
 * trace played forward as it was read (replay_forward_off): the same again.
 * The first byte
 * picks options (PyTorch's addresses or fresh ones, a small memory cap, given
 * settings, a device size, strict, the recording taken from its fourth event
 * on: the state before it inferred), the rest is the file.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cca.h"
#include "replay_compare.h"
#include "replay_events.h"

static void replay(const char *path, const cca_replay_options_t *opt, cca_status_t *st, char *msg,
                   size_t msg_size, cca_replay_result_t *r)
{
    *st = cca_replay_file(path, opt, r);
    snprintf(msg, msg_size, "%s", *st == CCA_OK ? "" : cca_last_error()->message);
    if (cca_is_initialized())
        abort(); /* a replay leaves cca shut down, whatever happened */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[64];
    cca_replay_options_t opt;
    int pick = fuzz_replay_input(data, size, "replay", path, sizeof(path), &opt);
    if (pick < 0)
        return 0;
    opt.strict = pick & 64;
    opt.first_event = pick & 128 ? 3 : 0;
    static char msg[3][2048];
    cca_status_t st[3];
    cca_replay_result_t r[3];
    opt.sequential = true;
    replay(path, &opt, &st[0], msg[0], sizeof(msg[0]), &r[0]);
    opt.sequential = false;
    replay(path, &opt, &st[1], msg[1], sizeof(msg[1]), &r[1]);
    opt.sequential = true;
    replay_forward_off = true;
    replay(path, &opt, &st[2], msg[2], sizeof(msg[2]), &r[2]);
    replay_forward_off = false;
    unlink(path);
    for (int k = 1; k < 3; k++) {
        if (st[0] != st[k] || strcmp(msg[0], msg[k])) {
            fprintf(stderr, "fuzz_replay: sequential %d \"%s\", %s %d \"%s\"\n", st[0], msg[0],
                    k == 1 ? "overlapped" : "every event undone", st[k], msg[k]);
            abort();
        }
        if (st[0] == CCA_OK) {
            const char *diff = replay_result_diff(&r[0], &r[k]);
            if (diff) {
                fprintf(stderr, "fuzz_replay: the results differ (%s) in %s\n",
                        k == 1 ? "overlapped" : "every event undone", diff);
                abort();
            }
        }
    }
    if (st[0] == CCA_OK)
        for (int k = 0; k < 3; k++)
            cca_replay_result_free(&r[k]);
    return 0;
}
