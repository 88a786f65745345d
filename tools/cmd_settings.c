/*
 * cmd_settings.c - `cca settings ['key:value,...']`: prints the effective
 * value of every settings key and where it came from (default, the
 * CCA_ALLOC_CONF environment variable, or the argument). Needs no device.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cca.h"
#include "cli.h"

static void settings_usage(FILE *out)
{
    fprintf(out,
            "usage: cca settings ['key:value,key:value,...']\n"
            "\n"
            "Prints every allocator settings key as 'key value (source)', where source is\n"
            "default, environment (CCA_ALLOC_CONF) or argument. The argument is applied\n"
            "after CCA_ALLOC_CONF. An invalid string is reported and the exit status is 1.\n");
}

/* Exit status: 0 printed, 1 invalid settings (message on stderr), 2 usage error. */
int cmd_settings(int argc, char **argv)
{
    const char *settings = NULL;
    char *text = NULL;

    if (argc > 2) {
        settings_usage(stderr);
        return 2;
    }
    if (argc == 2) {
        if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
            settings_usage(stdout);
            return 0;
        }
        settings = argv[1];
    }
    cca_status_t status = cca_settings_describe(settings, &text);
    if (status != CCA_OK) {
        fprintf(stderr, "cca settings: %s\n", cca_last_error()->message);
        return 1;
    }
    fputs(text, stdout);
    free(text);
    return 0;
}
