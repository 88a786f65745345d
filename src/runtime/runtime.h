/*
 * runtime.h - whole-allocator entry points of the layer that composes the
 * device and host allocators (src/runtime), for tests and fuzzers.
 */
#ifndef CCA_RUNTIME_H
#define CCA_RUNTIME_H

#include <stddef.h>

#include "internal.h"

/*
 * Check every invariant of cca: the device allocator's
 * (device_check_invariants, whose locking rules apply) and the pinned host
 * allocator's. why (may be NULL) receives the first violation. Returns
 * CCA_OK (also when cca is not initialised), CCA_ERR_INTERNAL (an invariant
 * failed), CCA_ERR_OUT_OF_MEMORY (no host memory for the check itself).
 */
cca_status_t alloc_check_invariants(char *why, size_t why_len);

#endif /* CCA_RUNTIME_H */
