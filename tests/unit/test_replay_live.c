/*
 * test_replay_live.c - the replay's table of live blocks (src/replay/replay_live.h):
 * one entry per key whatever deleted entries lie on its probe, counts that follow
 * puts and deletes, and a table rebuilt at its size when deletes dominate.
 */
#include "harness.h"
#include "replay_live.h"

/* Keys that probe from the same slot of a 1024-slot table (the first table's size). */
static size_t colliding(uint64_t *keys, size_t want)
{
    size_t n = 0;
    size_t home = live_hash(0x1000) & 1023;
    for (uint64_t k = 0x1000; n < want; k += 0x200)
        if ((live_hash(k) & 1023) == home)
            keys[n++] = k;
    return n;
}

TEST(a_key_put_again_past_a_deleted_entry_keeps_one_entry)
{
    live_map_t m = {0};
    uint64_t k[3];
    expect_eq_u64(colliding(k, 3), 3);
    live_entry_t *a = live_put(&m, k[0]);
    live_entry_t *b = live_put(&m, k[1]);
    expect_true(a && b);
    b->ptr = 42;
    live_del(&m, a); /* a deleted entry now lies before k[1] on its probe */
    expect_eq_u64(m.count, 1);
    live_entry_t *again = live_put(&m, k[1]);
    expect_true(again == b); /* the same entry, reset; no second one in the deleted slot */
    expect_eq_u64(again->ptr, 0);
    expect_eq_u64(m.count, 1);
    live_del(&m, again);
    expect_eq_u64(m.count, 0);
    expect_true(live_find(&m, k[1]) == NULL);
    /* a new key takes the first deleted slot of its probe */
    live_entry_t *c = live_put(&m, k[2]);
    expect_true(c != NULL && live_find(&m, k[2]) == c);
    expect_eq_u64(m.count, 1);
    free(m.slots);
}

TEST(get_reports_what_was_there)
{
    live_map_t m = {0};
    bool had = true;
    live_entry_t *e = live_get(&m, 0x5000, &had);
    expect_true(e && !had);
    e->ptr = 7;
    e = live_get(&m, 0x5000, &had);
    expect_true(e && had);
    expect_eq_u64(e->ptr, 7);
    expect_eq_u64(m.count, 1);
    free(m.slots);
}

TEST(many_puts_and_deletes_keep_the_table_small)
{
    live_map_t m = {0};
    for (uint64_t i = 1; i <= 100000; i++) {
        live_entry_t *e = live_put(&m, i << 9);
        expect_true(e != NULL);
        if (!e)
            break;
        e->ptr = i;
        if (i > 8)
            live_del(&m, live_find(&m, (i - 8) << 9));
    }
    expect_eq_u64(m.count, 8);
    expect_true(m.cap <= 1024); /* rebuilt at its size, not doubled with every allocation */
    for (uint64_t i = 100000 - 7; i <= 100000; i++) {
        live_entry_t *e = live_find(&m, i << 9);
        expect_true(e != NULL && e->ptr == i);
    }
    free(m.slots);
}

int main(void)
{
    RUN(a_key_put_again_past_a_deleted_entry_keeps_one_entry);
    RUN(get_reports_what_was_there);
    RUN(many_puts_and_deletes_keep_the_table_small);
    return harness_done();
}
