/*
 * Reclaiming processes at a sandbox's pids limit.
 *
 * A fork refused with EAGAIN means the sandbox's pids cgroup is full (or the
 * kernel's pid space is, which the same cure helps). The platform must still
 * run the next command, so it takes processes back, in this order:
 *
 *  1. Leftovers of finished commands: once a command's reaper exits, its
 *     orphans re-parent to the sandbox's init. They keep the session of the
 *     reaper that started them (every command runs in the session its reaper
 *     created), so a fork bomb is one big session. Sessions are killed
 *     biggest first until at least half of the leftover processes are gone:
 *     the bomb goes, a lone `nohup server &` usually stays.
 *  2. Only if that frees nothing: the biggest tree under a running command's
 *     reaper (a bomb inside a live session shell, say). Its command then
 *     ends by SIGKILL.
 *
 * Two views of one sandbox do this. Inside (fork_reclaiming, from the daemon
 * or a reaper, which live in the sandbox's mount namespace): its /proc, where
 * the init is pid 1 and reapers have parent 0 (outside the namespace). From
 * the host (`dsec-helper pids-reclaim`, which the edge runs when it finds the
 * sandbox exhausted before a call): the pids listed in the sandbox's
 * cgroup.procs, the init and the daemon by their host pids. The host side is
 * the fast one under a fork bomb: the sandbox's own share of the CPU goes
 * mostly to the bomb, and every /proc read then costs a hundred times more.
 *
 * Processes are signalled through a /proc/PID directory fd with
 * pidfd_send_signal, which needs no pid translation and cannot hit a
 * recycled pid: the fd pins the process, and its start time is checked
 * against the scan. The chosen groups are stopped first (SIGSTOP), rescanning
 * for members born meanwhile, and killed once none are new: a stopped process
 * cannot fork, and it keeps its pid, so a bomb cannot refill what the kill
 * frees while the kill is still going on.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "chronus.h"
#include "cmds.h"
#include "util.h"

#define RECLAIM_BUDGET_MS 1500 /* the whole reclaim-and-retry, per fork */
#define RECLAIM_PASSES 16      /* rescans per round, for children born while stopping */

/* Which processes make up the sandbox, how its init and reapers are recognised, how to take them. */
struct proc_view {
    int cgroup_procs_fd; /* the sandbox's cgroup.procs (host view); -1: every entry of /proc */
    pid_t init_pid;      /* 1 inside */
    pid_t reaper_ppid;   /* parent of the reapers: 0 inside (outside the namespace), the daemon's pid outside */
    /*
     * Inside, the chosen groups are stopped before they are killed (a bomb
     * would refill the pids a kill frees). From the host nothing can fork
     * meanwhile (pids.max is 0), so they are killed at once, through the
     * /proc/PID fds the scan keeps open (which pin the process: no second
     * read of its stat to rule out a recycled pid).
     */
    int from_host;
};

static const struct proc_view INSIDE = { .cgroup_procs_fd = -1, .init_pid = 1, .reaper_ppid = 0, .from_host = 0 };

struct proc_entry {
    int fd; /* its /proc/PID directory, kept by a host-view scan; -1: closed */
    pid_t pid, ppid, sid;
    unsigned long long start;
    pid_t key;  /* group: session (leftovers) or root reaper (running trees); 0: not a candidate */
    char state; /* Z: a zombie, which holds its pid until reaped but cannot be killed */
    int kind;   /* K_* below */
};

enum { K_UNKNOWN, K_INIT, K_REAPER, K_LEFTOVER, K_RUNNING };

static long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Reads pid, ppid, session and start time from an open /proc/PID directory; 0 or -1. */
static int read_stat(int dirfd, struct proc_entry *e)
{
    char buf[1024];
    int fd = openat(dirfd, "stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    if (!p)
        return -1;
    char state;
    long ppid, pgrp, sid;
    unsigned long long start;
    /* state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
       cutime cstime priority nice threads itrealvalue starttime */
    if (sscanf(p + 1, " %c %ld %ld %ld %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu",
               &state, &ppid, &pgrp, &sid, &start) != 5)
        return -1;
    e->state = state;
    e->ppid = (pid_t)ppid;
    e->sid = (pid_t)sid;
    e->start = start;
    return 0;
}

static int by_pid(const void *a, const void *b)
{
    pid_t x = ((const struct proc_entry *)a)->pid, y = ((const struct proc_entry *)b)->pid;
    return (x > y) - (x < y);
}

static struct proc_entry *find_proc(struct proc_entry *v, size_t n, pid_t pid)
{
    struct proc_entry k = { .pid = pid };
    return bsearch(&k, v, n, sizeof *v, by_pid);
}

/* Appends e to *v (growing it); 0, or -1 out of memory (*v unchanged). */
static int push_proc(struct proc_entry **v, size_t *n, size_t *cap, const struct proc_entry *e)
{
    if (*n == *cap) {
        struct proc_entry *bigger = realloc(*v, 2 * *cap * sizeof **v);
        if (!bigger)
            return -1;
        *v = bigger;
        *cap *= 2;
    }
    (*v)[(*n)++] = *e;
    return 0;
}

/* Scans keep /proc/PID fds below this number (set by the helper from its fd limit): a fd
   that could not be kept only costs a second stat read. */
static int fd_keep_below;

static void free_procs(struct proc_entry *v, size_t n)
{
    for (size_t i = 0; v && i < n; i++)
        if (v[i].fd >= 0)
            close(v[i].fd);
    free(v);
}

/* Adds the process `pid` (a /proc entry name) unless it exited meanwhile; keeps its fd if `keep`. */
static int add_pid(struct proc_entry **v, size_t *n, size_t *cap, uint64_t pid, int keep)
{
    char name[24];
    snprintf(name, sizeof name, "/proc/%llu", (unsigned long long)pid);
    int fd = open(name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    struct proc_entry e = { .fd = -1, .pid = (pid_t)pid };
    if (read_stat(fd, &e) < 0) {
        close(fd);
        return 0;
    }
    if (keep && fd < fd_keep_below)
        e.fd = fd;
    else
        close(fd);
    if (push_proc(v, n, cap, &e) == 0)
        return 0;
    if (e.fd >= 0)
        close(e.fd);
    return -1;
}

/* The pids of a cgroup.procs file, read whole; NULL-terminated text, or NULL. */
static char *read_cgroup_procs(int fd)
{
    size_t cap = 1 << 16, len = 0;
    char *text = malloc(cap);
    for (;;) {
        if (!text)
            return NULL;
        ssize_t r = pread(fd, text + len, cap - 1 - len, (off_t)len);
        if (r < 0) {
            free(text);
            return NULL;
        }
        len += (size_t)r;
        if (r == 0)
            break;
        if (len + 1 == cap) {
            char *bigger = realloc(text, cap *= 2);
            if (!bigger)
                free(text);
            text = bigger;
        }
    }
    text[len] = 0;
    return text;
}

/* Every process of the sandbox, classified; NULL when its processes cannot be listed. */
static struct proc_entry *scan_procs(const struct proc_view *view, size_t *count)
{
    size_t n = 0, cap = 256;
    struct proc_entry *v = malloc(cap * sizeof *v);
    int failed = 0;
    if (!v)
        return NULL;
    if (view->cgroup_procs_fd >= 0) {
        char *text = read_cgroup_procs(view->cgroup_procs_fd), *save = NULL;
        if (!text) {
            free(v);
            return NULL;
        }
        for (char *line = strtok_r(text, "\n", &save); !failed && line; line = strtok_r(NULL, "\n", &save)) {
            uint64_t pid;
            failed = !parse_u64(line, INT32_MAX, &pid) && add_pid(&v, &n, &cap, pid, view->from_host) < 0;
        }
        free(text);
    } else {
        DIR *d = opendir("/proc");
        if (!d) {
            free(v);
            return NULL;
        }
        struct dirent *de;
        while (!failed && (de = readdir(d))) {
            uint64_t pid;
            failed = !parse_u64(de->d_name, INT32_MAX, &pid) && add_pid(&v, &n, &cap, pid, view->from_host) < 0;
        }
        closedir(d);
    }
    if (failed) {
        free_procs(v, n);
        return NULL;
    }
    qsort(v, n, sizeof *v, by_pid);
    for (size_t i = 0; i < n; i++) {
        if (v[i].pid == view->init_pid)
            v[i].kind = K_INIT;
        else if (v[i].ppid == view->reaper_ppid)
            v[i].kind = K_REAPER;
    }
    for (size_t i = 0; i < n; i++) {
        if (v[i].kind != K_UNKNOWN)
            continue;
        struct proc_entry *up = &v[i];
        size_t depth = 0;
        while (up && up->kind == K_UNKNOWN && up->ppid != 0 && depth++ < n)
            up = find_proc(v, n, up->ppid);
        if (!up || up->kind == K_UNKNOWN)
            continue; /* the chain broke (a parent exited mid-scan), or it is not the sandbox's */
        if (up->kind == K_INIT || up->kind == K_LEFTOVER) {
            v[i].kind = K_LEFTOVER;
            v[i].key = v[i].sid;
        } else {
            v[i].kind = K_RUNNING;
            v[i].key = up->kind == K_REAPER ? up->pid : up->key;
        }
    }
    *count = n;
    return v;
}

/* Signals one scanned process if it is still the same one; returns 1 if signalled. */
static int signal_proc(const struct proc_entry *e, int sig)
{
    if (e->fd >= 0)
        return syscall(SYS_pidfd_send_signal, e->fd, sig, NULL, 0) == 0;
    char name[24];
    snprintf(name, sizeof name, "/proc/%d", (int)e->pid);
    int fd = open(name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    struct proc_entry now = { .pid = e->pid };
    int ok = read_stat(fd, &now) == 0 && now.start == e->start &&
             syscall(SYS_pidfd_send_signal, fd, sig, NULL, 0) == 0;
    close(fd);
    return ok;
}

struct proc_group {
    pid_t key;
    size_t size;
};

static int by_key(const void *a, const void *b)
{
    pid_t x = *(const pid_t *)a, y = *(const pid_t *)b;
    return (x > y) - (x < y);
}

static int by_size_desc(const void *a, const void *b)
{
    size_t x = ((const struct proc_group *)a)->size, y = ((const struct proc_group *)b)->size;
    return (x < y) - (x > y);
}

/* Whether `key` is one of the sorted `keys`. */
static int key_in(pid_t key, const pid_t *keys, size_t n)
{
    return n && bsearch(&key, keys, n, sizeof *keys, by_key) != NULL;
}

/*
 * One round: picks the groups of `kind` to kill (leftovers: sessions biggest
 * first until half the leftovers; running: the biggest tree), stops their
 * members, rescanning for members born meanwhile until none is new, then
 * kills every member it stopped. Returns how many processes it killed, plus
 * the chosen groups' zombies (pids on their way back); 0: nothing of that
 * kind to take.
 */
static uint32_t reclaim_round(const struct proc_view *view, int kind, struct reclaim_stats *stats)
{
    size_t n = 0;
    struct proc_entry *v = scan_procs(view, &n);
    if (!v)
        return 0;
    /*
     * Group sizes: candidates' keys sorted, counted in runs, biggest run first.
     * A leftover zombie counts: a group killed in an earlier round holds its
     * pids until init reaps them (promptly), and a round that left them out
     * would take the next group (a lone background process) while the bomb's
     * pids are on their way back. (A running tree's zombies wait for their own
     * parent, which may never reap them: they do not count.) Only live members
     * are signalled.
     */
    size_t nc = 0, nkeys = 0, taken = 0;
    struct proc_group *g = malloc((n + 1) * sizeof *g);
    pid_t *keys = malloc((n + 1) * sizeof *keys);
    for (size_t i = 0; g && keys && i < n; i++)
        if (v[i].kind == kind && (v[i].state != 'Z' || kind == K_LEFTOVER))
            keys[nc++] = v[i].key;
    if (g && keys) {
        qsort(keys, nc, sizeof *keys, by_key);
        size_t ng = 0;
        for (size_t i = 0; i < nc; i++) {
            if (ng && g[ng - 1].key == keys[i])
                g[ng - 1].size++;
            else
                g[ng++] = (struct proc_group){ .key = keys[i], .size = 1 };
        }
        qsort(g, ng, sizeof *g, by_size_desc);
        size_t want = kind == K_LEFTOVER ? (nc + 1) / 2 : 1;
        while (nkeys < ng && taken < want) {
            keys[nkeys] = g[nkeys].key;
            taken += g[nkeys++].size;
        }
        qsort(keys, nkeys, sizeof *keys, by_key);
    }
    uint32_t dying = 0;
    for (size_t i = 0; i < n; i++)
        dying += kind == K_LEFTOVER && v[i].kind == kind && v[i].state == 'Z' && key_in(v[i].key, keys, nkeys);
    /*
     * The members signalled so far (sorted by pid after each pass: one found
     * again is not new); inside, the ones stopped, to kill at the end.
     */
    int sig = view->from_host ? SIGKILL : SIGSTOP;
    size_t nsignalled = 0, cap = n + 1;
    struct proc_entry *signalled = nkeys ? malloc(cap * sizeof *signalled) : NULL;
    uint32_t killed = 0;
    for (int pass = 0; signalled && pass < RECLAIM_PASSES; pass++) {
        size_t before = nsignalled;
        for (size_t i = 0; i < n; i++) {
            if (v[i].kind != kind || v[i].state == 'Z' || !key_in(v[i].key, keys, nkeys))
                continue;
            struct proc_entry *seen = before ? find_proc(signalled, before, v[i].pid) : NULL;
            if (seen && seen->start == v[i].start)
                continue;
            if (nsignalled == cap) { /* no room to remember it: kill it now */
                struct proc_entry *bigger = realloc(signalled, 2 * cap * sizeof *signalled);
                if (!bigger) {
                    killed += (uint32_t)signal_proc(&v[i], SIGKILL);
                    continue;
                }
                signalled = bigger;
                cap *= 2;
            }
            if (signal_proc(&v[i], sig)) {
                killed += sig == SIGKILL;
                signalled[nsignalled] = v[i];
                signalled[nsignalled++].fd = -1; /* the scan's, closed with it */
            }
        }
        free_procs(v, n);
        v = NULL;
        if (nsignalled == before)
            break;
        qsort(signalled, nsignalled, sizeof *signalled, by_pid);
        if (!(v = scan_procs(view, &n)))
            break;
    }
    for (size_t i = 0; sig == SIGSTOP && i < nsignalled; i++)
        killed += (uint32_t)signal_proc(&signalled[i], SIGKILL);
    if (killed) {
        stats->killed += killed;
        stats->groups += (uint32_t)nkeys;
    }
    free(signalled);
    free_procs(v, n);
    free(g);
    free(keys);
    /* Zombies of the chosen groups free their pids once reaped: progress to wait for. */
    return killed + dying;
}

pid_t fork_reclaiming(struct reclaim_stats *stats)
{
    pid_t pid = fork();
    if (pid >= 0 || errno != EAGAIN)
        return pid;
    long deadline = mono_ms() + RECLAIM_BUDGET_MS;
    int kind = K_LEFTOVER;
    while (mono_ms() < deadline) {
        if (!reclaim_round(&INSIDE, kind, stats)) {
            if (kind == K_RUNNING)
                break;
            kind = K_RUNNING;
            continue;
        }
        /* A killed process frees its pid once reaped (by the init, mostly): retry for a while. */
        for (int wait_ms = 1;; wait_ms *= 2) {
            pid = fork();
            if (pid >= 0 || errno != EAGAIN)
                return pid;
            if (wait_ms > 256 || mono_ms() >= deadline)
                break;
            struct timespec ts = { 0, wait_ms * 1000000L };
            nanosleep(&ts, NULL);
        }
    }
    return fork(); /* whatever the rounds freed last; EAGAIN if nothing */
}

/*
 * dsec-helper pids-reclaim CGROUP_DIR INIT_PID DAEMON_PID LIMIT: the first
 * kind of reclaim (leftovers of finished commands), from the host, for a
 * sandbox whose pids cgroup is CGROUP_DIR, whose init and command daemon have
 * these host pids. Prints `killed N groups G`.
 *
 * Meanwhile the cgroup's pids.max is 0, so nothing in the sandbox can fork:
 * a bomb's processes cannot refill the pids its dying members free, and the
 * round converges in a pass or two. pids.max is LIMIT (the sandbox's own)
 * again before this exits; the edge writes it once more in case this died.
 */
int cmd_pids_reclaim(int argc, char **argv)
{
    uint64_t init, daemon, limit;
    if (argc != 4 || parse_u64(argv[1], INT32_MAX, &init) || parse_u64(argv[2], INT32_MAX, &daemon) ||
        parse_u64(argv[3], INT32_MAX, &limit) || !init || !daemon)
        dief(EINVAL, "usage: pids-reclaim CGROUP_DIR INIT_PID DAEMON_PID LIMIT");
    char path[4096];
    snprintf(path, sizeof path, "%s/cgroup.procs", argv[0]);
    struct proc_view view = { .cgroup_procs_fd = open(path, O_RDONLY | O_CLOEXEC),
                              .init_pid = (pid_t)init,
                              .reaper_ppid = (pid_t)daemon,
                              .from_host = 1 };
    if (view.cgroup_procs_fd < 0)
        dief(errno, "open %s", path);
    struct rlimit files;
    if (getrlimit(RLIMIT_NOFILE, &files) == 0) {
        files.rlim_cur = files.rlim_max;
        (void)!setrlimit(RLIMIT_NOFILE, &files);
        if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur > 64)
            fd_keep_below = files.rlim_cur > INT32_MAX ? INT32_MAX - 64 : (int)files.rlim_cur - 64;
    }
    snprintf(path, sizeof path, "%s/pids.max", argv[0]);
    int max_fd = open(path, O_WRONLY | O_CLOEXEC);
    int lowered = max_fd >= 0 && pwrite(max_fd, "0", 1, 0) == 1;
    struct reclaim_stats stats = { 0 };
    reclaim_round(&view, K_LEFTOVER, &stats);
    char text[24];
    snprintf(text, sizeof text, "%llu", (unsigned long long)limit);
    if (lowered && pwrite(max_fd, text, strlen(text), 0) < 0)
        dief(errno, "restore %s", path);
    printf("killed %u groups %u\n", stats.killed, stats.groups);
    return 0;
}
