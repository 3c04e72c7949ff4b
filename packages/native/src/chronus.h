/*
 * chronus: the per-sandbox command daemon. It lives in the sandbox's
 * namespaces and cgroups but outside its pid namespace, listens on a host
 * socket the sandbox cannot see, and runs each command under a "reaper"
 * process that reports the kernel's wait status. Each one is forked (not
 * exec'd) by the node's supervisor, chronusd, so its pages stay shared.
 */
#ifndef DSEC_CHRONUS_H
#define DSEC_CHRONUS_H

#include <linux/filter.h>
#include <stdint.h>
#include <sys/types.h>

/* What /proc/PID/cmdline and comm of the supervisor and of each daemon say. */
#define CHRONUSD_TITLE "dsec-chronusd"
#define CHRONUS_TITLE "dsec-chronus"

/* Frame types of the client protocol (see README in the TypeScript wrapper). */
enum {
    F_SPAWN = 0x01,
    F_STDIN = 0x02,
    F_STDIN_EOF = 0x03,
    F_SIGNAL = 0x04,
    F_KILL_TREE = 0x05,
    F_RESIZE = 0x06,
    F_STARTED = 0x81,
    F_SPAWN_ERROR = 0x82,
    F_STDOUT = 0x83,
    F_STDERR = 0x84,
    F_EXIT = 0x85,
};

enum {
    SPAWN_SHELL = 1u << 0,
    SPAWN_STDIN = 1u << 1,
    SPAWN_PTY = 1u << 2,
    SPAWN_DETACHED = 1u << 3,
};

#define FRAME_HEADER 9u /* u32 len | u8 type | u32 stream */
#define MAX_PAYLOAD (1u << 20)
#define EXIT_PAYLOAD 28u /* i32 status | u64 user_usec | u64 sys_usec | u64 maxrss_kib */
/* Largest reaper → daemon message: type byte + SPAWN_ERROR errno + message. */
#define REAPER_MSG_MAX 512u
/* STARTED: u32 pid | u32 processes reclaimed | u32 groups reclaimed (see struct reclaim_stats). */
#define STARTED_PAYLOAD 12u

struct spawn_request {
    uint32_t flags, uid, gid;
    uint16_t rows, cols;
    const char *cwd, *user;
    char **argv; /* NULL-terminated */
    char **envp; /* NULL-terminated */
};

/*
 * Parses a SPAWN payload; req's strings point into p (which must outlive
 * it). 0, or -1 when malformed. spawn_request_free frees the arrays.
 */
int spawn_request_parse(unsigned char *p, size_t len, struct spawn_request *req);
void spawn_request_free(struct spawn_request *req);

/*
 * Daemon → idle reaper: run this command ([REAPER_RUN][SPAWN payload], the
 * command's pipes attached as SCM_RIGHTS). Only commands without a pty or
 * SPAWN_DETACHED, and payloads up to REAPER_RUN_MAX bytes (a socket
 * buffer's worth), go to an idle reaper; others get a new one.
 */
#define REAPER_RUN 0x10
#define REAPER_RUN_MAX (64u << 10)

/* The reaper's end of each channel; -1 where absent. */
struct reaper_fds {
    int ctl;        /* SOCK_SEQPACKET to the daemon */
    int stdin_r;    /* pipe read end, or -1 for an empty stdin */
    int stdout_w;   /* pipe write end, or the pty slave */
    int stderr_w;   /* pipe write end, or the pty slave */
    int shell_memfd;
};

/*
 * What reclaiming at the sandbox's process limit did before a fork went
 * through (reaper.c): processes SIGKILLed and the groups (sessions of
 * finished commands, or trees of running ones) they belonged to. STARTED
 * carries both after the pid, so the edge can record the event.
 */
struct reclaim_stats {
    uint32_t killed, groups;
};

/*
 * fork(), but when it fails with EAGAIN (the sandbox's pids cgroup is at
 * pids.max) it kills what holds the processes, biggest first, and retries
 * within a bounded time; -1 with errno EAGAIN if that did not free one.
 * Works from the daemon (outside the sandbox's pid namespace) and from a
 * reaper (inside): it only uses the sandbox's /proc and pidfd signals.
 */
pid_t fork_reclaiming(struct reclaim_stats *stats);

/*
 * The nice value of the daemon, its reapers and the sandbox's init (set
 * while the daemon still holds the host's CAP_SYS_NICE, and only when it sits
 * in a CPU cgroup of the sandbox, where weights count against the sandbox's
 * own processes alone): a sandbox that saturates its CPU share (a fork bomb's
 * thousand runnable processes) cannot starve the platform's next command.
 * Commands never inherit it: a reaper sets SCHED_RESET_ON_FORK, so what it
 * starts begins at nice 0 (at the daemon's own nice when that was higher).
 */
#define PLATFORM_NICE (-20)

/* Runs in the forked reaper (inside the sandbox pid namespace); never returns. */
_Noreturn void reaper_main(const struct spawn_request *req, const struct reaper_fds *fds);

/*
 * Every signal back to its default disposition. A daemon whose reapers run
 * commands calls it once at start, before it ignores SIGPIPE and SIGCHLD:
 * those two are then the only dispositions a command could inherit (exec
 * resets handled signals, not ignored ones), and each command resets just
 * them instead of every signal.
 */
void reaper_default_signals(void);

struct chronus_state {
    int listen_fd;
    int init_pidfd;
    int shell_memfd;
    int sock_dirfd;        /* host directory of the socket, for unlinking it at exit */
    const char *sock_name; /* basename inside sock_dirfd */
    ino_t sock_ino;
};

/* The event loop; exits the process when the sandbox init dies. */
_Noreturn void chronus_serve(const struct chronus_state *st);

/* One sandbox's daemon, as the edge's `prepare` request describes it. */
struct chronus_request {
    const char *sock;       /* host path of the command socket (its directory must be root-only) */
    const char *caps;       /* "CAP_A,CAP_B,..." bounding the commands; NULL keeps every capability */
    const char **cgroups;   /* cgroup directories to join (they must exist) */
    int ncgroups;
    int no_new_privs;
    int net;                         /* configure the sandbox's end of its veth (a `net` line) before serving */
    const struct sock_fprog *filter; /* compiled seccomp program; NULL loads none */
};

/* One address of the sandbox's interface and the gateway of its default route (chronus_net.c). */
#define CHRONUS_NET_MAX_ADDRS 2 /* one per family */
struct chronus_net_addr {
    int family; /* AF_INET or AF_INET6 */
    unsigned char prefixlen;
    unsigned char addr[16], gateway[16];
};
struct chronus_net {
    char ifname[16];
    int naddrs;
    struct chronus_net_addr addrs[CHRONUS_NET_MAX_ADDRS];
};

/* Parses `IFNAME ADDR/PLEN GATEWAY [ADDR/PLEN GATEWAY]` (modifies line); 0 or -EINVAL. */
int chronus_net_parse(char *line, struct chronus_net *out);

/*
 * From inside the sandbox's network namespace: loopback and IFNAME up, the
 * addresses on IFNAME, a default route per family. 0, or -errno with the
 * failed step in err.
 */
int chronus_net_apply(const struct chronus_net *cfg, char *err, size_t errlen);

/* Copies the platform shell into a sealed memfd (CLOEXEC); dies on errors. */
int chronus_seal_shell(const char *path);

/*
 * Runs in the supervisor's forked child: `conn` (the edge's request
 * connection) becomes fds 0-2; writes "pid N", joins the cgroups, binds the
 * socket, writes "prepared", reads the init's PID, enters the sandbox
 * (with `net`: reads a `net` line, configures the interface, writes
 * "configured") and writes "ready"; then serves. Any failure is one line on the connection and exit status 1.
 */
_Noreturn void chronus_daemon(const struct chronus_request *req, int conn, int shell_memfd, int devnull);

#endif
