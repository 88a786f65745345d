/*
 * check.h - the device allocator's invariant checker, for tests, fuzzers and
 * the expensive assertions of CCA_DEBUG >= 3.
 */
#ifndef CCA_CHECK_H
#define CCA_CHECK_H

#include <stddef.h>

#include "internal.h"

/*
 * Check every invariant of the device caching allocator, recomputing the
 * statistics from the structures (see check.c for the list). Takes every
 * allocator lock (device -> stream pools -> events, stats, pointer map), so
 * it sees a consistent state provided no other thread is between the steps
 * of a call that holds no lock across them (cca_free between the pointer map
 * and its pool): call it from a quiescent point. why (may be NULL) receives
 * the first violation found. Returns CCA_OK (also when cca is not
 * initialised), CCA_ERR_INTERNAL (an invariant failed; the message says
 * which), CCA_ERR_OUT_OF_MEMORY (no host memory for the check itself).
 */
cca_status_t device_check_invariants(char *why, size_t why_len);

/* device_check_invariants(NULL, 0) == CCA_OK, for cca_assert_expensive. */
bool device_is_valid(void);

#endif /* CCA_CHECK_H */
