/*
 * dsec-helper: the few host operations Node cannot do itself (mount(2),
 * idmapped mounts, FUSE mounts, setns, conntrack entries), plus chronusd, the
 * node's supervisor of the per-sandbox command daemons, `confine`/`tree`,
 * through which every operation on a directory tree a sandbox made runs
 * (confine.c), and pids-reclaim (reclaim.c).
 * Usage: dsec-helper <subcommand> [args...]; errors are one line on stderr
 * and exit status 1.
 */
#include <stdio.h>
#include <string.h>

#include "cmds.h"
#include "util.h"

static const struct {
    const char *name;
    int (*run)(int argc, char **argv);
} commands[] = {
    { "mount-erofs", cmd_mount_erofs },
    { "mount-fuse", cmd_mount_fuse },
    { "umount", cmd_umount },
    { "mount-rootfs", cmd_mount_rootfs },
    { "chronusd", cmd_chronusd },
    { "seccomp-bpf", cmd_seccomp_bpf },
    { "conntrack", cmd_conntrack },
    { "confine", cmd_confine },
    { "tree", cmd_tree },
    { "pids-reclaim", cmd_pids_reclaim },
};

int main(int argc, char **argv)
{
    save_argv(argc, argv);
    if (argc >= 2) {
        for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
            if (strcmp(argv[1], commands[i].name) == 0)
                return commands[i].run(argc - 2, argv + 2);
        }
    }
    fprintf(stderr, "usage: dsec-helper mount-erofs|mount-fuse|umount|mount-rootfs|chronusd|seccomp-bpf|conntrack|confine|tree|pids-reclaim ...\n");
    return 2;
}
