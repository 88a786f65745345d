/*
 * test_peer.c - peer access between simulated devices: cca_can_access_peer,
 * cca_enable_peer_access (idempotent, recorded in the accessed device's
 * list, nothing recorded on failure), cca_peer_access_list,
 * cca_memcpy_peer_async (data copied between devices in backed mode), the
 * cudaMallocAsync backend's per-pool access, and misuse.
 */
#include <stdint.h>
#include <stdlib.h>

#include "device.h"
#include "harness.h"

#define MiB ((size_t)1 << 20)

static cca_backend_t *sim;

static void setup(int devices, bool backed, bool no_peer, const char *settings)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = devices;
    cfg.total_memory = 1ull << 30;
    cfg.backed = backed;
    cfg.no_peer_access = no_peer;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, settings) != CCA_OK) {
        printf("cannot set up: %s\n", cca_last_error()->message);
        exit(1);
    }
}

static size_t peers_of(int device, int *out, size_t cap)
{
    size_t n = 0;
    expect_ok(cca_peer_access_list(device, out, cap, &n));
    return n;
}

TEST(can_access_peer)
{
    setup(3, false, false, "");
    bool can = false;
    expect_ok(cca_can_access_peer(0, 1, &can));
    expect_true(can);
    expect_ok(cca_can_access_peer(2, 0, &can));
    expect_true(can);
    expect_ok(cca_can_access_peer(1, 1, &can));
    expect_false(can); /* a device is not its own peer, as cudaDeviceCanAccessPeer */
    setup(2, false, true, "");
    expect_ok(cca_can_access_peer(0, 1, &can));
    expect_false(can);
}

TEST(enable_records_the_accessing_device)
{
    setup(4, false, false, "");
    int peers[8];
    expect_eq_u64(peers_of(1, peers, 8), 0);
    uint64_t calls = cca_sim_call_count(sim, CCA_OP_ENABLE_PEER_ACCESS);
    /* device 0 and device 3 may access device 1's memory */
    expect_ok(cca_enable_peer_access(3, 1));
    expect_ok(cca_enable_peer_access(0, 1));
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_ENABLE_PEER_ACCESS), calls + 2);
    expect_eq_u64(peers_of(1, peers, 8), 2);
    expect_eq_i64(peers[0], 0);
    expect_eq_i64(peers[1], 3);
    /* the other direction is separate */
    expect_eq_u64(peers_of(0, peers, 8), 0);
    expect_eq_u64(peers_of(3, peers, 8), 0);
    /* again: nothing new, no backend call */
    expect_ok(cca_enable_peer_access(0, 1));
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_ENABLE_PEER_ACCESS), calls + 2);
    expect_eq_u64(peers_of(1, peers, 8), 2);
    /* a short buffer still gets the total */
    expect_eq_u64(peers_of(1, peers, 1), 2);
    expect_eq_i64(peers[0], 0);
    size_t n = 9;
    expect_ok(cca_peer_access_list(1, NULL, 0, &n));
    expect_eq_u64(n, 2);
    /* the list is cleared by shutdown */
    setup(4, false, false, "");
    expect_eq_u64(peers_of(1, peers, 8), 0);
}

TEST(enable_failure_records_nothing)
{
    setup(2, false, true, "");
    int peers[4];
    expect_status(cca_enable_peer_access(0, 1), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "cannot access");
    expect_eq_u64(peers_of(1, peers, 4), 0);
    setup(2, false, false, "");
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_ENABLE_PEER_ACCESS, 1, false, CCA_ERR_BACKEND));
    expect_status(cca_enable_peer_access(0, 1), CCA_ERR_BACKEND);
    expect_eq_u64(peers_of(1, peers, 4), 0);
    expect_ok(cca_enable_peer_access(0, 1)); /* the fault was once */
    expect_eq_u64(peers_of(1, peers, 4), 1);
}

TEST(misuse)
{
    setup(2, false, false, "");
    bool can;
    size_t n;
    int peers[2];
    expect_status(cca_enable_peer_access(0, 0), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_enable_peer_access(-1, 0), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_enable_peer_access(0, 2), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_can_access_peer(0, 5, &can), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_can_access_peer(0, 1, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_peer_access_list(2, peers, 2, &n), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_peer_access_list(0, NULL, 2, &n), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_peer_access_list(0, peers, 2, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_memcpy_peer_async(NULL, 0, peers, 1, 8, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_memcpy_peer_async(peers, 3, peers, 1, 8, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(cca_memcpy_peer_async(NULL, 0, NULL, 1, 0, NULL)); /* nothing to copy */
    expect_eq_u64(peers_of(0, peers, 2), 0);
    expect_eq_u64(peers_of(1, peers, 2), 0);
}

TEST(memcpy_between_devices)
{
    setup(2, true, false, "");
    unsigned char *a = NULL, *b = NULL;
    expect_ok(cca_malloc_device((void **)&a, 3 * MiB, 0, NULL));
    expect_ok(cca_malloc_device((void **)&b, 3 * MiB, 1, NULL));
    for (size_t i = 0; i < 3 * MiB; i++)
        a[i] = (unsigned char)(i * 7 + 1);
    expect_ok(cca_enable_peer_access(1, 0));
    expect_ok(cca_memcpy_peer_async(b, 1, a, 0, 3 * MiB, NULL));
    size_t bad = 0;
    for (size_t i = 0; i < 3 * MiB; i++)
        bad += b[i] != (unsigned char)(i * 7 + 1);
    expect_eq_u64(bad, 0);
    expect_ok(cca_free(a));
    expect_ok(cca_free(b));
}

TEST(async_backend_sets_pool_access)
{
    setup(2, false, false, "backend:cudaMallocAsync");
    uint64_t dev_calls = cca_sim_call_count(sim, CCA_OP_ENABLE_PEER_ACCESS);
    uint64_t pool_calls = cca_sim_call_count(sim, CCA_OP_MEMPOOL_SET_ACCESS);
    expect_ok(cca_enable_peer_access(1, 0));
    /* as PyTorch's cudaMallocAsync backend: access to device 0's pool, nothing device-wide */
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_MEMPOOL_SET_ACCESS), pool_calls + 1);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_ENABLE_PEER_ACCESS), dev_calls);
    int peers[2];
    expect_eq_u64(peers_of(0, peers, 2), 1);
    expect_eq_i64(peers[0], 1);
}

int main(void)
{
    RUN(can_access_peer);
    RUN(enable_records_the_accessing_device);
    RUN(enable_failure_records_nothing);
    RUN(misuse);
    RUN(memcpy_between_devices);
    RUN(async_backend_sets_pool_access);
    cca_shutdown();
    return harness_done();
}
