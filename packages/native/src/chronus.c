/*
 * One sandbox's command daemon, forked by the supervisor (chronusd.c): sets
 * it up and hands over to the event loop in chronus_loop.c. Everything that
 * needs the host view (/proc/INITPID, the socket path, cgroup files) is
 * opened before the daemon enters the sandbox's namespaces; the sealed shell
 * and the compiled seccomp program come ready-made from the supervisor.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/seccomp.h>
#include <libgen.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/capability.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "chronus.h"
#include "util.h"

/* Reads one line the edge sends on stdin (without its newline); dies at EOF or when it is too long. */
static void read_line(char *buf, size_t size, const char *what)
{
    size_t n = 0;
    for (;;) {
        ssize_t r = read(0, buf + n, 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            dief(r < 0 ? errno : EPIPE, "reading %s from stdin", what);
        if (buf[n] == '\n')
            break;
        if (++n == size - 1)
            dief(E2BIG, "reading %s from stdin", what);
    }
    buf[n] = 0;
}

/* Reads the sandbox init's host PID, a decimal line the edge sends once the runtime reported it. */
static pid_t read_pid_line(void)
{
    char buf[24];
    read_line(buf, sizeof buf, "the init pid");
    uint64_t pid;
    if (parse_u64(buf, INT32_MAX, &pid) || pid == 0)
        dief(EINVAL, "bad init pid %s", buf);
    return (pid_t)pid;
}

/*
 * With `net`: the edge sends `net IFNAME ADDR/PLEN GATEWAY [ADDR/PLEN GATEWAY]`
 * once it has made the veth with its far end in the sandbox's namespace, which
 * we are in now; we configure that end and say `configured`.
 */
static void configure_network(void)
{
    char line[256];
    read_line(line, sizeof line, "the network configuration");
    struct chronus_net cfg;
    if (strncmp(line, "net ", 4) != 0 || chronus_net_parse(line + 4, &cfg) < 0)
        dief(EINVAL, "bad network configuration line");
    char err[128];
    int r = chronus_net_apply(&cfg, err, sizeof err);
    if (r < 0)
        die(err, -r);
    static const char configured[] = "configured\n";
    if (write_all(1, configured, sizeof configured - 1) < 0)
        _exit(1);
}

/*
 * Copies the platform shell into a sealed memfd. Commands with the SHELL
 * flag exec this copy, so whatever the sandbox does to its own /bin/sh (or
 * to /proc/<pid>/exe of a running shell) cannot change or reach the host file.
 */
int chronus_seal_shell(const char *path)
{
    int src = open(path, O_RDONLY | O_CLOEXEC);
    if (src < 0)
        dief(errno, "open shell %s", path);
    int mfd = memfd_create("dsec-shell", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (mfd < 0)
        die("memfd_create", errno);
    char buf[65536];
    ssize_t n;
    while ((n = read(src, buf, sizeof buf)) > 0) {
        int r = write_all(mfd, buf, (size_t)n);
        if (r < 0)
            die("write shell memfd", -r);
    }
    if (n < 0)
        dief(errno, "read shell %s", path);
    close(src);
    if (fcntl(mfd, F_ADD_SEALS, F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE) < 0)
        die("seal shell memfd", errno);
    return mfd;
}

/* Joined in this order, as nsenter does: user first so that the others are owned by it. */
static const struct {
    const char *name;
    int type;
} namespaces[] = {
    { "user", CLONE_NEWUSER }, { "cgroup", CLONE_NEWCGROUP }, { "ipc", CLONE_NEWIPC }, { "uts", CLONE_NEWUTS },
    { "net", CLONE_NEWNET },   { "pid", CLONE_NEWPID },       { "mnt", CLONE_NEWNS },
};
#define NNS (sizeof namespaces / sizeof namespaces[0])

/* Opens the target's namespaces; -1 marks one we already share (setns would refuse a user ns). */
static void open_namespaces(pid_t pid, int fds[NNS])
{
    for (size_t i = 0; i < NNS; i++) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/ns/%s", pid, namespaces[i].name);
        fds[i] = open(path, O_RDONLY | O_CLOEXEC);
        if (fds[i] < 0)
            dief(errno, "open %s", path);
        struct stat theirs, ours;
        snprintf(path, sizeof path, "/proc/self/ns/%s", namespaces[i].name);
        if (fstat(fds[i], &theirs) < 0 || stat(path, &ours) < 0)
            dief(errno, "stat namespace %s", namespaces[i].name);
        if (theirs.st_ino == ours.st_ino && theirs.st_dev == ours.st_dev) {
            close(fds[i]);
            fds[i] = -1;
        }
    }
}

static void enter_namespaces(int fds[NNS])
{
    for (size_t i = 0; i < NNS; i++) {
        if (fds[i] < 0)
            continue;
        if (setns(fds[i], namespaces[i].type) < 0)
            dief(errno, "setns %s", namespaces[i].name);
        close(fds[i]);
        if (namespaces[i].type == CLONE_NEWUSER) {
            /* Become the namespace's root (like nsenter): the daemon then holds no
             * host uid at all; its capabilities apply only inside the sandbox.
             * setgroups fails where the sandbox's setgroups is "deny"; harmless. */
            (void)!setgroups(0, NULL);
            if (setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0)
                die("become root of the sandbox user namespace", errno);
        }
    }
    /* setns(mnt) leaves the cwd pointing into the host tree. */
    if (chdir("/") < 0)
        die("chdir / in the sandbox", errno);
}

/* Binds the listening socket (mode 0600) and keeps its directory open for cleanup. */
static void make_socket(const char *path, struct chronus_state *st)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    if (strlen(path) >= sizeof addr.sun_path)
        dief(ENAMETOOLONG, "socket path %s", path);
    strcpy(addr.sun_path, path);

    char dir[PATH_MAX], base[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", path);
    snprintf(base, sizeof base, "%s", path);
    st->sock_dirfd = open(dirname(dir), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (st->sock_dirfd < 0)
        dief(errno, "open socket directory of %s", path);
    st->sock_name = strdup(basename(base));

    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        die("socket", errno);
    if (unlink(path) < 0 && errno != ENOENT)
        dief(errno, "unlink stale socket %s", path);
    mode_t old = umask(0077); /* no window in which the socket is group/world accessible */
    int r = bind(fd, (struct sockaddr *)&addr, sizeof addr);
    umask(old);
    if (r < 0)
        dief(errno, "bind %s", path);
    struct stat sb;
    if (chmod(path, 0600) < 0 || stat(path, &sb) < 0)
        dief(errno, "chmod %s", path);
    st->sock_ino = sb.st_ino;
    if (listen(fd, 128) < 0)
        dief(errno, "listen %s", path);
    st->listen_fd = fd;
}

static void join_cgroups(const char **dirs, int n)
{
    char pid[24];
    snprintf(pid, sizeof pid, "%d\n", getpid());
    for (int i = 0; i < n; i++) {
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/cgroup.procs", dirs[i]);
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        int r = fd < 0 ? -errno : write_all(fd, pid, strlen(pid));
        if (fd >= 0)
            close(fd);
        if (r < 0)
            dief(-r, "join cgroup %s", path);
    }
}

/* Whether one of the joined cgroups limits CPU (v1 cpu, or v2 with the cpu controller). */
static int in_cpu_cgroup(const char **dirs, int n)
{
    for (int i = 0; i < n; i++) {
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/cpu.shares", dirs[i]);
        if (access(path, F_OK) == 0)
            return 1;
        snprintf(path, sizeof path, "%s/cpu.weight", dirs[i]);
        if (access(path, F_OK) == 0)
            return 1;
    }
    return 0;
}

/* Parses "CAP_A,cap_b,..." into values; dies on unknown names. */
static int parse_caps(const char *list, cap_value_t *out, int max)
{
    int n = 0;
    char *copy = strdup(list), *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        for (char *c = tok; *c; c++)
            *c = (char)(*c >= 'A' && *c <= 'Z' ? *c + 32 : *c);
        cap_value_t v;
        if (cap_from_name(tok, &v) < 0 || n >= max)
            dief(EINVAL, "unknown capability %s", tok);
        out[n++] = v;
    }
    free(copy);
    return n;
}

/*
 * Bounds every command to `caps`: the bounding set is exactly `caps`, so a
 * root command gets exactly those at exec and a non-root one gets none.
 * The daemon keeps CAP_SETUID/CAP_SETGID (to switch a command to its user)
 * and CAP_KILL (a reaper must SIGKILL trees of other users) in its own
 * permitted/effective sets; the inheritable set is `caps`.
 */
static void limit_capabilities(const cap_value_t *caps, int n, int last_cap)
{
    for (int c = 0; c <= last_cap; c++) {
        int keep = 0;
        for (int i = 0; i < n; i++)
            keep |= caps[i] == c;
        if (!keep && prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0 && errno != EINVAL)
            dief(errno, "drop capability %d from the bounding set", c);
    }
}

static void set_daemon_capabilities(const cap_value_t *caps, int n)
{
    static const cap_value_t needed[] = { CAP_SETUID, CAP_SETGID, CAP_KILL };
    cap_t c = cap_init();
    if (!c || cap_set_flag(c, CAP_INHERITABLE, n, caps, CAP_SET) ||
        cap_set_flag(c, CAP_PERMITTED, n, caps, CAP_SET) || cap_set_flag(c, CAP_EFFECTIVE, n, caps, CAP_SET) ||
        cap_set_flag(c, CAP_PERMITTED, 3, needed, CAP_SET) || cap_set_flag(c, CAP_EFFECTIVE, 3, needed, CAP_SET))
        die("build capability set", errno);
    if (cap_set_proc(c) < 0)
        die("capset", errno);
    cap_free(c);
}

static int read_last_cap(void)
{
    FILE *f = fopen("/proc/sys/kernel/cap_last_cap", "re");
    int last = CAP_LAST_CAP;
    if (f) {
        if (fscanf(f, "%d", &last) != 1)
            last = CAP_LAST_CAP;
        fclose(f);
    }
    return last;
}

_Noreturn void chronus_daemon(const struct chronus_request *req, int conn, int shell_memfd, int devnull)
{
    /* The edge's connection is our stdin (the init pid), stdout ("pid", "ready")
     * and stderr (die() messages), so every failure reaches the edge. */
    for (int fd = 0; fd <= 2; fd++)
        if (dup2(conn, fd) < 0)
            _exit(1);
    close(conn);
    /* Our own session: signals to the supervisor's group must not reach us. */
    setsid();
    /* Not the supervisor's command line: `ps` shows no host path, and the
     * edge recognises us by this name plus the sandbox's cgroup. */
    set_process_title(CHRONUS_TITLE);
    prctl(PR_SET_NAME, CHRONUS_TITLE, 0, 0, 0);
    char line[32];
    snprintf(line, sizeof line, "pid %d\n", getpid());
    if (write_all(1, line, strlen(line)) < 0)
        _exit(1);

    /* Joined first, so that what we allocate from here on is charged to the
     * sandbox (cgroup v1 moves no charges with a task). */
    join_cgroups(req->cgroups, req->ncgroups);
    cap_value_t caps[64];
    int ncaps = req->caps ? parse_caps(req->caps, caps, 64) : 0;
    int last_cap = read_last_cap();
    struct chronus_state st = { .shell_memfd = shell_memfd };
    make_socket(req->sock, &st);
    /* The edge sends the init pid only after this line: had we died first, its
       write would fail (EPIPE) and could take our error line down with it. */
    static const char prepared[] = "prepared\n";
    if (write_all(1, prepared, sizeof prepared - 1) < 0)
        _exit(1);

    pid_t init_pid = read_pid_line();
    st.init_pidfd = (int)syscall(SYS_pidfd_open, init_pid, 0);
    if (st.init_pidfd < 0)
        dief(errno, "pidfd_open %d", init_pid);
    /* Best effort: without it (no CAP_SYS_NICE) the platform only competes as before. */
    if (in_cpu_cgroup(req->cgroups, req->ncgroups)) {
        (void)!setpriority(PRIO_PROCESS, 0, PLATFORM_NICE);
        (void)!setpriority(PRIO_PROCESS, (id_t)init_pid, PLATFORM_NICE);
    }
    int nsfds[NNS];
    open_namespaces(init_pid, nsfds);
    enter_namespaces(nsfds);

    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0)
        die("prctl(PR_SET_DUMPABLE)", errno);
    /* While we still hold CAP_NET_ADMIN over the sandbox's network namespace. */
    if (req->net)
        configure_network();
    if (req->caps)
        limit_capabilities(caps, ncaps, last_cap);
    if (req->no_new_privs && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        die("prctl(PR_SET_NO_NEW_PRIVS)", errno);
    /* Loaded while CAP_SYS_ADMIN (in the sandbox's user namespace) is still
     * effective, so it works without no_new_privs. */
    if (req->filter && syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, req->filter) < 0)
        die("load seccomp filter", errno);
    if (req->caps)
        set_daemon_capabilities(caps, ncaps);

    static const char ready[] = "ready\n";
    int r = write_all(1, ready, sizeof ready - 1);
    if (r < 0)
        die("write ready", -r);
    /* The edge forgets the connection now; nothing of it may stay open. */
    for (int fd = 0; fd <= 2; fd++)
        dup2(devnull, fd);
    close(devnull);
    chronus_serve(&st);
}
