/*
 * sim_faults.c - fault injection and the errors every operation of the
 * simulated backend shares: each operation enters through sim_enter_locked,
 * which counts the call and fails it when a test armed a fault (once, or
 * from then on). The controls that arm faults and read the counters are in
 * sim_control.c.
 * Invariant: a call that fails by injection changes no simulated state.
 */
#include <stdio.h>

#include "simulator.h"

/* Count a call of op and fire its injected fault, if due. */
cca_status_t sim_enter_locked(sim_ctx_t *c, cca_backend_op_t op)
{
    sim_fault_t *f = &c->faults[op];
    c->calls[op]++;
    if (f->failing)
        goto fail;
    if (f->countdown == 0 || --f->countdown > 0)
        return CCA_OK;
    if (f->persistent)
        f->failing = true;
fail:
    return cca_backend_error(f->status, 0, "sim: %s: injected fault (call %llu)",
                             cca_backend_op_name(op), (unsigned long long)c->calls[op]);
}

/* ---- helpers (lock held) ---------------------------------------------------------- */

cca_status_t sim_bad_device(sim_ctx_t *c, cca_backend_op_t op, int device)
{
    return cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                             "sim: %s: invalid device ordinal %d (the backend has %d devices)",
                             cca_backend_op_name(op), device, c->device_count);
}

cca_status_t sim_host_oom(cca_backend_op_t op)
{
    return cca_backend_error(CCA_ERR_BACKEND, 0, "sim: %s: host out of memory for bookkeeping",
                             cca_backend_op_name(op));
}
