/*
 * cli.h - the subcommands of the `cca` command line. Each returns the
 * process exit status (0 success, 1 failure, 2 usage error).
 */
#ifndef CCA_CLI_H
#define CCA_CLI_H

typedef int (*cli_command_fn)(int argc, char **argv);

int cmd_settings(int argc, char **argv);
int cmd_replay(int argc, char **argv);
int cmd_snapshot(int argc, char **argv);

#endif /* CCA_CLI_H */
