/*
 * main.c - the `cca` command line: dispatches to a subcommand. The tool is a
 * client of the public API only.
 */
#include <stdio.h>
#include <string.h>

#include "cca.h"
#include "cli.h"

static const struct {
    const char *name;
    cli_command_fn fn;
    const char *help;
} commands[] = {
    {"settings", cmd_settings, "settings ['key:value,...']   print the effective settings"},
    {"replay", cmd_replay, "replay TRACE [options]        replay a PyTorch memory snapshot (see --help)"},
    {"snapshot", cmd_snapshot, "snapshot FILE --json [OUT] | --svg OUT  convert a memory snapshot to JSON or SVG"},
};

static void usage(FILE *out)
{
    fprintf(out, "usage: cca <command> [arguments]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
        fprintf(out, "  %s\n", commands[i].help);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version")) {
        printf("cca %d.%d.%d\n", CCA_VERSION_MAJOR, CCA_VERSION_MINOR, CCA_VERSION_PATCH);
        return 0;
    }
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
        if (!strcmp(argv[1], commands[i].name))
            return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "cca: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
