/*
 * chronus: the per-sandbox command daemon. It lives in the sandbox's
 * namespaces and cgroups but outside its pid namespace, listens on a host
 * socket the sandbox cannot see, and runs each command under a "reaper"
 * process that reports the kernel's wait status.
 */
#ifndef DSEC_CHRONUS_H
#define DSEC_CHRONUS_H

#include <stdint.h>
#include <sys/types.h>

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

struct spawn_request {
    uint32_t flags, uid, gid;
    uint16_t rows, cols;
    const char *cwd, *user;
    char **argv; /* NULL-terminated */
    char **envp; /* NULL-terminated */
};

/* The reaper's end of each channel; -1 where absent. */
struct reaper_fds {
    int ctl;        /* SOCK_SEQPACKET to the daemon */
    int stdin_r;    /* pipe read end, or -1 for an empty stdin */
    int stdout_w;   /* pipe write end, or the pty slave */
    int stderr_w;   /* pipe write end, or the pty slave */
    int shell_memfd;
};

/* Runs in the forked reaper (inside the sandbox pid namespace); never returns. */
_Noreturn void reaper_main(const struct spawn_request *req, const struct reaper_fds *fds);

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

#endif
