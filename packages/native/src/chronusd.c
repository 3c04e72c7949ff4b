/*
 * `dsec-helper chronusd --dir DIR --shell SHELLBIN`: the node's chronus
 * supervisor. One long-lived process per node seals the platform shell into
 * a memfd once, compiles each distinct seccomp profile once, and listens on
 * DIR/ctl.sock (DIR must be root-only). For every `prepare` request it forks
 * a sandbox's command daemon (chronus.c) without exec, so the daemons share
 * the supervisor's pages copy-on-write and one copy of the shell.
 *
 * The daemons are independent of the supervisor once forked: each has its own
 * session and its own connection to the edge, and a supervisor crash leaves
 * them serving (they are reparented). Protocol: packages/native/PROTOCOL.md.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "chronus.h"
#include "cmds.h"
#include "seccomp_profile.h"
#include "util.h"

#define PROTOCOL_VERSION 2 /* 2: prepare's `net` */
#define REQUEST_MAX (1u << 20)
#define REQUEST_TIMEOUT_MS 5000 /* a client that stalls mid-request holds up the others at most this long */
#define FILTER_CACHE 8          /* distinct profiles kept compiled (the edge uses one) */

static struct {
    const char *shell;
    int listen_fd, shell_memfd, devnull;
} sup;

/* ---- compiled seccomp programs, by profile text ---- */

static struct {
    char *profile;
    struct sock_fprog prog;
} filters[FILTER_CACHE];
static unsigned filters_next;

static long now_ms(void);

/*
 * Compiles in a short-lived child: libseccomp's many allocations would
 * otherwise fragment our heap, and every daemon forked later would dirty
 * (copy) the pages its own mallocs land on (measured: 92 KiB of heap per
 * daemon instead of 20). The child sends a tag byte (0: program follows,
 * 1: error text follows) and exits; EOF ends the answer.
 */
static int compile_isolated(const char *profile, struct sock_fprog *out, char *err, size_t errlen)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0) {
        snprintf(err, errlen, "compile seccomp profile: pipe: %s", strerror(errno));
        return -1;
    }
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        struct sock_fprog prog;
        char msg[512];
        unsigned char tag = seccomp_profile_compile(profile, &prog, msg, sizeof msg) < 0;
        int r = write_all(p[1], &tag, 1);
        if (r == 0)
            r = tag ? write_all(p[1], msg, strlen(msg)) : write_all(p[1], prog.filter, prog.len * sizeof *prog.filter);
        _exit(r < 0);
    }
    int fork_err = errno;
    close(p[1]);
    if (pid < 0) {
        close(p[0]);
        snprintf(err, errlen, "compile seccomp profile: fork: %s", strerror(fork_err));
        return -1;
    }
    /* Outside the heap, for the same reason. */
    size_t cap = 1 + BPF_MAXINSNS * sizeof(struct sock_filter), len = 0;
    unsigned char *buf = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    long deadline = now_ms() + REQUEST_TIMEOUT_MS;
    int failed = buf == MAP_FAILED;
    while (!failed) {
        struct pollfd pfd = { .fd = p[0], .events = POLLIN };
        long left = deadline - now_ms();
        if (left <= 0 || poll(&pfd, 1, (int)left) <= 0) {
            failed = 1;
            break;
        }
        ssize_t n = read(p[0], buf + len, cap - len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        len += (size_t)n;
        failed = len == cap && buf[0] != 0; /* an error text never fills the buffer */
    }
    close(p[0]);
    if (failed)
        kill(pid, SIGKILL); /* reaped by the kernel (SIGCHLD is ignored) */
    int r = -1;
    size_t size = len > 0 ? len - 1 : 0;
    if (failed || len == 0)
        snprintf(err, errlen, "compile seccomp profile: the compiler failed");
    else if (buf[0] != 0)
        snprintf(err, errlen, "%.*s", (int)size, (const char *)buf + 1);
    else if (size == 0 || size % sizeof(struct sock_filter) || !(out->filter = malloc(size)))
        snprintf(err, errlen, "compile seccomp profile: bad program");
    else {
        memcpy(out->filter, buf + 1, size);
        out->len = (unsigned short)(size / sizeof(struct sock_filter));
        r = 0;
    }
    if (buf != MAP_FAILED)
        munmap(buf, cap);
    return r;
}

static const struct sock_fprog *filter_for(const char *profile, char *err, size_t errlen)
{
    for (unsigned i = 0; i < FILTER_CACHE; i++)
        if (filters[i].profile && strcmp(filters[i].profile, profile) == 0)
            return &filters[i].prog;
    struct sock_fprog prog;
    char *copy = strdup(profile);
    if (!copy) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    if (compile_isolated(profile, &prog, err, errlen) < 0) {
        free(copy);
        return NULL;
    }
    unsigned slot = filters_next++ % FILTER_CACHE; /* oldest out */
    free(filters[slot].profile);
    free(filters[slot].prog.filter);
    filters[slot].profile = copy;
    filters[slot].prog = prog;
    return &filters[slot].prog;
}

/* ---- one request ---- */

static long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Reads exactly len bytes before `deadline_ms`; returns 0 or -1. */
static int read_full(int fd, void *buf, size_t len, long deadline_ms)
{
    char *p = buf;
    while (len > 0) {
        long left = deadline_ms - now_ms();
        struct pollfd pfd = { .fd = fd, .events = POLLIN };
        if (left <= 0 || poll(&pfd, 1, (int)left) <= 0)
            return -1;
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* A best-effort one-line answer: the client may be gone, and must not stall us. */
static void reply(int conn, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void reply(int conn, const char *fmt, ...)
{
    char line[600];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof line - 1)
        n = (int)sizeof line - 1;
    (void)!send(conn, line, (size_t)n, MSG_DONTWAIT | MSG_NOSIGNAL);
}

/*
 * Fills req from `key value` string pairs (req->cgroups must have room for
 * n / 2 entries); returns 0, or -1 with the reason in err.
 */
static int parse_prepare(char **kv, size_t n, struct chronus_request *req, const char **profile, char *err,
                         size_t errlen)
{
    if (n % 2) {
        snprintf(err, errlen, "prepare: odd number of strings");
        return -1;
    }
    for (size_t i = 0; i < n; i += 2) {
        const char *key = kv[i], *val = kv[i + 1];
        if (strcmp(key, "sock") == 0)
            req->sock = val;
        else if (strcmp(key, "cgroup") == 0)
            req->cgroups[req->ncgroups++] = val;
        else if (strcmp(key, "caps") == 0)
            req->caps = val;
        else if (strcmp(key, "no-new-privs") == 0)
            req->no_new_privs = strcmp(val, "1") == 0;
        else if (strcmp(key, "seccomp") == 0)
            *profile = val;
        else if (strcmp(key, "net") == 0)
            req->net = strcmp(val, "1") == 0;
        else {
            snprintf(err, errlen, "prepare: unknown key %s", key);
            return -1;
        }
    }
    if (!req->sock || req->sock[0] != '/') {
        snprintf(err, errlen, "prepare: needs an absolute sock path");
        return -1;
    }
    return 0;
}

static void handle(int conn)
{
    struct ucred peer;
    socklen_t plen = sizeof peer;
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &peer, &plen) < 0 || peer.uid != 0)
        return; /* the directory already keeps others out; this keeps a mistake from mattering */
    long deadline = now_ms() + REQUEST_TIMEOUT_MS;
    unsigned char hdr[4];
    if (read_full(conn, hdr, 4, deadline) < 0)
        return;
    uint32_t len = get_u32(hdr);
    if (len == 0 || len > REQUEST_MAX) {
        reply(conn, "dsec-helper: chronusd: bad request length %u\n", len);
        return;
    }
    /*
     * The request and its index live outside the heap (mmap): a daemon forked
     * below keeps them (its settings point into them) and never writes them,
     * and our heap stays compact, so the daemon's own mallocs do not land on
     * (and copy) pages it shares with us.
     */
    size_t n = 0, index_size = 0;
    char **strs = MAP_FAILED;
    struct chronus_request req = { 0 };
    char err[512] = "";
    char *payload = mmap(NULL, (size_t)len + 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (payload == MAP_FAILED || read_full(conn, payload, len, deadline) < 0)
        goto out;
    payload[len] = 0; /* a last string without its NUL still ends */
    for (char *p = payload; p < payload + len; p += strlen(p) + 1)
        n++;
    index_size = (n + 1 + n / 2 + 1) * sizeof *strs; /* the strings, then room for the cgroups */
    strs = mmap(NULL, index_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (strs == MAP_FAILED)
        goto out;
    n = 0;
    for (char *p = payload; p < payload + len; p += strlen(p) + 1)
        strs[n++] = p;
    req.cgroups = (const char **)(strs + n + 1);
    if (strcmp(strs[0], "ping") == 0) {
        reply(conn, "chronusd %d %d %s\n", PROTOCOL_VERSION, getpid(), sup.shell);
        goto out;
    }
    if (strcmp(strs[0], "prepare") != 0) {
        reply(conn, "dsec-helper: chronusd: unknown request %.64s\n", strs[0]);
        goto out;
    }
    const char *profile = NULL;
    if (parse_prepare(strs + 1, n - 1, &req, &profile, err, sizeof err) < 0 ||
        (profile && !(req.filter = filter_for(profile, err, sizeof err)))) {
        reply(conn, "dsec-helper: %s\n", err);
        goto out;
    }
    pid_t pid = fork();
    if (pid == 0) {
        close(sup.listen_fd); /* a dead supervisor's socket must refuse connections */
        chronus_daemon(&req, conn, sup.shell_memfd, sup.devnull);
    }
    if (pid < 0)
        reply(conn, "dsec-helper: chronusd: fork: %s (errno %d)\n", strerror(errno), errno);
out:
    if (strs != MAP_FAILED)
        munmap(strs, index_size);
    if (payload != MAP_FAILED)
        munmap(payload, (size_t)len + 1);
}

/* ---- start-up ---- */

/* The directory holds the control socket: root's alone, or we refuse to serve. */
static void check_dir(const char *dir)
{
    struct stat sb;
    if (stat(dir, &sb) < 0)
        dief(errno, "chronusd: %s", dir);
    if (!S_ISDIR(sb.st_mode) || sb.st_uid != 0 || (sb.st_mode & 077))
        dief(EPERM, "chronusd: %s must be a directory owned by root with mode 0700", dir);
}

static int listen_on(const char *path)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    if (strlen(path) >= sizeof addr.sun_path)
        dief(ENAMETOOLONG, "socket path %s", path);
    strcpy(addr.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        die("socket", errno);
    if (unlink(path) < 0 && errno != ENOENT)
        dief(errno, "unlink stale socket %s", path);
    mode_t old = umask(0177); /* srw------- from the start */
    int r = bind(fd, (struct sockaddr *)&addr, sizeof addr);
    umask(old);
    if (r < 0)
        dief(errno, "bind %s", path);
    /* A burst of creates queues here while earlier requests are forked. */
    if (listen(fd, SOMAXCONN) < 0)
        dief(errno, "listen %s", path);
    return fd;
}

/* DIR/chronusd.pid, replaced atomically: the next edge adopts us through it. */
static void write_pid_file(const char *dir)
{
    char tmp[PATH_MAX], path[PATH_MAX], text[24];
    snprintf(tmp, sizeof tmp, "%s/chronusd.pid.tmp", dir);
    snprintf(path, sizeof path, "%s/chronusd.pid", dir);
    snprintf(text, sizeof text, "%d\n", getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    int r = fd < 0 ? -errno : write_all(fd, text, strlen(text));
    if (fd >= 0)
        close(fd);
    if (r < 0 || rename(tmp, path) < 0)
        dief(r < 0 ? -r : errno, "write %s", path);
}

int cmd_chronusd(int argc, char **argv)
{
    /* Copies: set_process_title() below overwrites the argv strings. */
    const char *dir = NULL;
    for (int i = 0; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--dir") == 0)
            dir = strdup(argv[i + 1]);
        else if (strcmp(argv[i], "--shell") == 0)
            sup.shell = strdup(argv[i + 1]);
        else
            dief(EINVAL, "chronusd: unknown option %s", argv[i]);
    }
    if (!dir || !sup.shell || argc % 2)
        dief(EINVAL, "usage: chronusd --dir DIR --shell SHELLBIN");
    /* Daemons inherit both: a vanished edge must not kill them with SIGPIPE,
     * and their reapers are reaped by the kernel (each reports its own status).
     * Nothing else the edge's own parent ignored lives on (reaper_default_signals). */
    reaper_default_signals();
    signal(SIGPIPE, SIG_IGN);
    signal(SIGCHLD, SIG_IGN);

    /* Whatever the edge's own parent leaked to it (non-CLOEXEC fds) must not
       live on in every daemon. */
    syscall(SYS_close_range, 3, ~0u, 0);
    check_dir(dir);
    sup.shell_memfd = chronus_seal_shell(sup.shell);
    sup.devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (sup.devnull < 0)
        die("open /dev/null", errno);
    char sock[PATH_MAX];
    snprintf(sock, sizeof sock, "%s/ctl.sock", dir);
    sup.listen_fd = listen_on(sock);
    write_pid_file(dir);
    /* The paths are in the pid file and the socket; `ps` shows just the role. */
    set_process_title(CHRONUSD_TITLE);
    prctl(PR_SET_NAME, CHRONUSD_TITLE, 0, 0, 0);

    /* The version line comes first: a client that knows only `ready PID` still finds its line. */
    printf("protocol %d\nready %d\n", PROTOCOL_VERSION, getpid());
    fflush(stdout);
    dup2(sup.devnull, 0);
    dup2(sup.devnull, 1); /* stderr stays: the edge points it at DIR/chronusd.log */

    for (;;) {
        int conn = accept4(sup.listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (conn < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == ENOBUFS)
                sleep(1); /* transient: keep the queue, retry instead of spinning */
            continue;
        }
        handle(conn);
        close(conn);
    }
}
