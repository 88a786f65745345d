/*
 * cli.h - the subcommands of the `cca` command line, and the helpers they
 * share. Each subcommand returns the process exit status (0 success,
 * 1 failure, 2 usage error).
 */
#ifndef CCA_CLI_H
#define CCA_CLI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "cca.h"

typedef int (*cli_command_fn)(int argc, char **argv);

int cmd_settings(int argc, char **argv);
int cmd_replay(int argc, char **argv);
int cmd_snapshot(int argc, char **argv);

/* A byte count with an optional K/M/G/T suffix (KiB, MB... alike: powers of 1024).
 * -1 for anything else, a negative number, or a value past SIZE_MAX. */
int cli_parse_size(const char *text, size_t *out);

/* s as a JSON string literal on out. */
void cli_json_string(FILE *out, const char *s);

/* Whether path can be read without blocking: it exists and is a regular file
 * (a FIFO or a device would block or never end). Says why on stderr if not. */
bool cli_input_ok(const char *cmd, const char *path);

/* Report cca's last error for path on stderr, naming path once. */
void cli_report_error(const char *cmd, const char *path);

/* The replay's report (cmd_replay.c): human text, and its JSON object without a newline. */
void replay_print_human(const char *path, const cca_replay_result_t *r, bool trace_addresses);
void replay_print_json_object(const cca_replay_result_t *r, bool trace_addresses);

/* The replay modes beyond the report (cmd_replay_explain.c). */
int replay_explain(const char *path, const cca_replay_options_t *opt, bool json);
int replay_fit(const char *path, const cca_replay_options_t *opt, char **settings, int count, bool json);

#endif /* CCA_CLI_H */
