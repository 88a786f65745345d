/*
 * struct_layout.c - prints the size and the offset of the last field of each
 * structure the Python package mirrors with ctypes, so its test notices when
 * cca.h changes and python/cca/_lib.py does not.
 */
#include <stddef.h>
#include <stdio.h>

#include "cca.h"

#define SHOW(type, last) printf("%s %zu %zu\n", #type, sizeof(type), offsetof(type, last))

int main(void)
{
    SHOW(cca_error_t, backend_code);
    SHOW(cca_stat_entry_t, value);
    SHOW(cca_device_stats_t, max_split_size);
    SHOW(cca_host_stats_t, host_free_time);
    SHOW(cca_replay_options_t, peaks_from_event);
    SHOW(cca_replay_result_t, ambiguous_blocks);
    SHOW(cca_explain_entry_t, count);
    SHOW(cca_replay_explain_t, free_segments);
    return 0;
}
