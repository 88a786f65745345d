/*
 * invariants.c - the whole-allocator invariant check: the device
 * allocator's checker followed by the pinned host allocator's.
 */
#include <stdio.h>

#include "check.h"
#include "host.h"
#include "runtime.h"

cca_status_t alloc_check_invariants(char *why, size_t why_len)
{
    cca_status_t st = device_check_invariants(why, why_len);
    if (st != CCA_OK)
        return st;
    if (host_global() && !host_is_valid(host_global())) {
        const char *msg = "the pinned host allocator's free lists, map or counters disagree";
        if (why && why_len)
            snprintf(why, why_len, "%s", msg);
        return cca_raise(CCA_ERR_INTERNAL, "allocator invariant violated: %s", msg);
    }
    return CCA_OK;
}
