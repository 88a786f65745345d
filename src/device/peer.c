/*
 * peer.c - peer access between devices: which devices may address another
 * device's memory, as PyTorch's enablePeerAccess(dev, dev_to_access) records
 * it (device_allocator[dev_to_access]->addPeerAccess(dev)).
 *
 * Invariant: bit p of devices[d].peer_mask is set exactly when the backend
 * enabled access from device p to device d's memory through cca (for the
 * cudaMallocAsync backend: access to d's pool). Bits are only ever added,
 * under device d's lock, so memory that d maps later (expandable segments'
 * ranges, which read the mask under the same lock) is made accessible to
 * every device in it.
 */
#include "device.h"
#include "async.h"
#include "state.h"

/* Validate a device index against the initialised state. */
static cca_status_t peer_device_arg(const char *what, int device)
{
    if (device < 0 || device >= cca_state->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: device %d is out of range (%d devices)",
                         what, device, cca_state->device_count);
    return CCA_OK;
}

cca_status_t cca_can_access_peer(int device, int peer, bool *can_access)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (!can_access)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_can_access_peer: can_access is NULL");
    st = peer_device_arg("cca_can_access_peer", device);
    if (st == CCA_OK)
        st = peer_device_arg("cca_can_access_peer", peer);
    if (st != CCA_OK)
        return st;
    if (device == peer) {
        *can_access = false; /* as cudaDeviceCanAccessPeer */
        return CCA_OK;
    }
    cca_backend_t *be = cca_state->backend;
    int can = 0;
    st = be->can_access_peer(be->ctx, device, peer, &can);
    if (st != CCA_OK)
        return st;
    *can_access = can != 0;
    return CCA_OK;
}

cca_status_t cca_enable_peer_access(int device, int peer)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    st = peer_device_arg("cca_enable_peer_access", device);
    if (st == CCA_OK)
        st = peer_device_arg("cca_enable_peer_access", peer);
    if (st != CCA_OK)
        return st;
    if (device == peer)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_enable_peer_access: device %d cannot be its own peer", device);
    cca_backend_t *be = cca_state->backend;
    cca_device_t *owner = &cca_state->devices[peer];
    uint64_t bit = (uint64_t)1 << device;
    pthread_mutex_lock(&owner->lock);
    if (atomic_load_explicit(&owner->peer_mask, memory_order_relaxed) & bit)
        goto out_unlock; /* already enabled through cca */
    if (async_enabled())
        /* cudaMallocAsync pools ignore device-wide peer access (PyTorch sets
         * access on the pool of the device whose memory is accessed). */
        st = be->mempool_set_access(be->ctx, peer, device);
    else
        st = be->enable_peer_access(be->ctx, device, peer);
    if (st != CCA_OK)
        goto out_unlock;
    /*
     * Expandable segments set access for `device` on the ranges `owner` has
     * mapped already, here, under owner->lock (PyTorch's addPeerAccess calls
     * addPeer on every existing expandable segment); later maps read the mask.
     */
    atomic_fetch_or_explicit(&owner->peer_mask, bit, memory_order_release);
    if (!async_enabled())
        st = expandable_add_peer(owner, device);
    if (st != CCA_OK) /* some ranges without access: not enabled, so a retry sets them all
                       * (access given twice is no error; no map runs meanwhile: owner->lock) */
        atomic_fetch_and_explicit(&owner->peer_mask, ~bit, memory_order_release);
out_unlock:
    pthread_mutex_unlock(&owner->lock);
    return st;
}

cca_status_t cca_peer_access_list(int device, int *peers, size_t cap, size_t *count)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (!count || (cap && !peers))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_peer_access_list: %s is NULL",
                         !count ? "count" : "peers");
    st = peer_device_arg("cca_peer_access_list", device);
    if (st != CCA_OK)
        return st;
    uint64_t mask = device_peer_mask(&cca_state->devices[device]);
    size_t n = 0;
    for (int p = 0; p < CCA_MAX_DEVICES; p++) {
        if (!(mask & ((uint64_t)1 << p)))
            continue;
        if (n < cap)
            peers[n] = p;
        n++;
    }
    *count = n;
    return CCA_OK;
}

cca_status_t cca_memcpy_peer_async(void *dst, int dst_device, const void *src, int src_device,
                                   size_t size, cca_stream_t stream)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    st = peer_device_arg("cca_memcpy_peer_async", dst_device);
    if (st == CCA_OK)
        st = peer_device_arg("cca_memcpy_peer_async", src_device);
    if (st != CCA_OK)
        return st;
    if (size == 0)
        return CCA_OK;
    if (!dst || !src)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_memcpy_peer_async: %s is NULL",
                         !dst ? "dst" : "src");
    cca_backend_t *be = cca_state->backend;
    return be->memcpy_peer_async(be->ctx, dst, dst_device, src, src_device, size, stream);
}

/* Give every device of dev's peer list access to [addr, addr + size) (dev->lock held). */
cca_status_t peer_set_access_locked(cca_device_t *dev, void *addr, size_t size)
{
    cca_backend_t *be = cca_state->backend;
    uint64_t mask = device_peer_mask(dev);
    for (int p = 0; mask && p < CCA_MAX_DEVICES; p++) {
        if (!(mask & ((uint64_t)1 << p)))
            continue;
        cca_status_t st = be->vmm_set_access(be->ctx, p, addr, size);
        if (st != CCA_OK)
            return st;
    }
    return CCA_OK;
}
