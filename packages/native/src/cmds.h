/* Entry points of the dsec-helper subcommands; each returns the exit status. */
#ifndef DSEC_CMDS_H
#define DSEC_CMDS_H

int cmd_mount_erofs(int argc, char **argv);
int cmd_mount_fuse(int argc, char **argv);
int cmd_umount(int argc, char **argv);
int cmd_mount_rootfs(int argc, char **argv);
int cmd_chronusd(int argc, char **argv);
int cmd_seccomp_bpf(int argc, char **argv);
int cmd_conntrack(int argc, char **argv);
int cmd_confine(int argc, char **argv);
int cmd_tree(int argc, char **argv);
int cmd_pids_reclaim(int argc, char **argv);

#endif
