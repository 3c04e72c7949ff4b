/*
 * The per-command reaper and the command's own setup before exec.
 *
 * The reaper runs inside the sandbox's pid namespace as a session leader and
 * child subreaper: orphans of the command re-parent to it, so it can find
 * and kill the whole tree, even processes that called setsid() or
 * double-forked. It reports STARTED / SPAWN_ERROR / EXIT to the daemon over
 * a SOCK_SEQPACKET pair; those messages are already in the client's frame
 * payload format (prefixed by the frame type byte).
 *
 * A reaper whose command ended cleanly (no process of its tree left, not
 * killed, nothing about the reaper changed from outside) offers, with its
 * EXIT, to run another: the daemon keeps it idle for a while and sends it
 * the next command (REAPER_RUN, with the command's pipes attached) instead
 * of forking a new reaper, which is most of what a short command costs.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "chronus.h"
#include "util.h"

/* Fixed fd layout inside the reaper; 0-2 are the command's stdio. */
enum { FD_CTL = 3, FD_SHELL = 4, FD_SIGNAL = 5 };

/*
 * Why the child could not exec. A vfork'd child runs on our memory and we
 * resume only once it exec'd or exited, so it leaves the reason here; a
 * forked one (the fallback) writes it to the CLOEXEC pipe err_pipe_w.
 */
struct spawn_failure {
    int err;
    char text[REAPER_MSG_MAX - 8];
};
static struct spawn_failure vfork_failure;
static int err_pipe_w = -1;

#define DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#define MAX_GROUPS 64

/* ---- messages to the daemon ---- */

static void send_msg(const void *msg, size_t len)
{
    (void)!send(FD_CTL, msg, len, MSG_NOSIGNAL);
}

static void send_spawn_error(int err, const char *text)
{
    unsigned char m[REAPER_MSG_MAX] = { F_SPAWN_ERROR };
    size_t n = strnlen(text, sizeof m - 5);
    put_u32(m + 1, (uint32_t)err);
    memcpy(m + 5, text, n);
    send_msg(m, 5 + n);
}

/* EXIT, with one more byte (1) when this reaper offers to run another command. */
static void send_exit(int status, const struct rusage *ru, int reusable)
{
    unsigned char m[1 + EXIT_PAYLOAD + 1] = { F_EXIT };
    put_u32(m + 1, (uint32_t)status);
    put_u64(m + 5, (uint64_t)ru->ru_utime.tv_sec * 1000000 + (uint64_t)ru->ru_utime.tv_usec);
    put_u64(m + 13, (uint64_t)ru->ru_stime.tv_sec * 1000000 + (uint64_t)ru->ru_stime.tv_usec);
    put_u64(m + 21, (uint64_t)ru->ru_maxrss);
    m[1 + EXIT_PAYLOAD] = 1;
    send_msg(m, reusable ? sizeof m : sizeof m - 1);
}

/* ---- SPAWN payloads (PROTOCOL.md), parsed by the daemon and by a reused reaper ---- */

/* Splits `n` NUL-terminated strings off *p; returns NULL if the payload ends first. */
static char **take_strings(char **p, char *end, uint32_t n)
{
    char **v = calloc((size_t)n + 1, sizeof *v);
    if (!v)
        return NULL;
    for (uint32_t i = 0; i < n; i++) {
        char *nul = memchr(*p, 0, (size_t)(end - *p));
        if (!nul) {
            free(v);
            return NULL;
        }
        v[i] = *p;
        *p = nul + 1;
    }
    return v;
}

int spawn_request_parse(unsigned char *p, size_t len, struct spawn_request *req)
{
    *req = (struct spawn_request){ 0 };
    char *s = (char *)p + 24, *end = (char *)p + len;
    char **head = NULL;
    uint32_t argc = len >= 24 ? get_u32(p + 16) : 0, envc = len >= 24 ? get_u32(p + 20) : 0;
    /* Each string takes at least its NUL, which bounds argc + envc by the payload size. */
    if (len < 24 || argc == 0 || argc > len || envc > len || !(head = take_strings(&s, end, 2)) ||
        !(req->argv = take_strings(&s, end, argc)) || !(req->envp = take_strings(&s, end, envc))) {
        free(head);
        spawn_request_free(req);
        return -1;
    }
    req->flags = get_u32(p);
    req->uid = get_u32(p + 4);
    req->gid = get_u32(p + 8);
    req->rows = get_u16(p + 12);
    req->cols = get_u16(p + 14);
    req->cwd = head[0];
    req->user = head[1];
    free(head);
    return 0;
}

void spawn_request_free(struct spawn_request *req)
{
    free(req->argv);
    free(req->envp);
    req->argv = req->envp = NULL;
}

/* ---- the command: resolved by the reaper, set up by its child until exec ---- */

/* Reports a setup failure of the child (see struct spawn_failure) and exits. */
static _Noreturn void child_fail(int err, const char *fmt, const char *arg)
{
    if (err_pipe_w < 0) {
        snprintf(vfork_failure.text, sizeof vfork_failure.text, fmt, arg);
        vfork_failure.err = err ? err : EINVAL;
        _exit(127);
    }
    struct spawn_failure msg = { .err = err ? err : EINVAL };
    snprintf(msg.text, sizeof msg.text, fmt, arg);
    (void)!write(err_pipe_w, &msg, sizeof msg.err + strlen(msg.text));
    _exit(127);
}

/*
 * Reads a small regular file of the sandbox (its /etc/passwd or /etc/group).
 * Never getpwnam(): NSS would load libraries from the sandbox into a
 * process that still holds the daemon's privileges.
 */
static char *read_small_file(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) < 0 || !S_ISREG(sb.st_mode) || sb.st_size > (4 << 20)) {
        if (fd >= 0)
            close(fd);
        return NULL;
    }
    char *text = malloc((size_t)sb.st_size + 1);
    ssize_t n = text ? read(fd, text, (size_t)sb.st_size) : -1;
    close(fd);
    if (n < 0) {
        free(text);
        return NULL;
    }
    text[n] = 0;
    return text;
}

/* Splits a colon-separated line into at most `max` fields in place; returns the count. */
static int split_fields(char *line, char **fields, int max)
{
    int n = 0;
    fields[n++] = line;
    for (char *p = line; *p && n < max; p++) {
        if (*p == ':') {
            *p = 0;
            fields[n++] = p + 1;
        }
    }
    return n;
}

struct identity {
    uid_t uid;
    gid_t gid;
    const char *name; /* NULL when unknown */
    const char *home; /* NULL when unknown */
    gid_t groups[MAX_GROUPS];
    int ngroups;
};

/*
 * One command, ready to start: everything that allocates or reads the
 * sandbox's files is done by the reaper before the (v)fork, so the child
 * writes nothing to the reaper's memory that the reaper would have to free.
 */
struct command {
    const struct spawn_request *req;
    struct identity id;
    char *passwd; /* the /etc/passwd text id.name and id.home point into */
    char **env;   /* the client's environment plus HOME and USER where missing */
    char *home_var, *user_var;
};

/* Finds the passwd entry by name (or by uid when name is NULL); fills id, keeps the text in *text. */
static int lookup_passwd(const char *name, uid_t uid, struct identity *id, char **text)
{
    char *all = read_small_file("/etc/passwd"), *save = NULL;
    if (!all)
        return 0;
    for (char *line = strtok_r(all, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *f[7];
        uint64_t u, g;
        if (split_fields(line, f, 7) < 7 || parse_u64(f[2], UINT32_MAX - 1, &u) ||
            parse_u64(f[3], UINT32_MAX - 1, &g))
            continue;
        if (name ? strcmp(f[0], name) == 0 : u == uid) {
            id->uid = (uid_t)u;
            id->gid = (gid_t)g;
            id->name = f[0];
            id->home = f[5];
            *text = all;
            return 1;
        }
    }
    free(all);
    return 0;
}

/*
 * Looks a group name up in /etc/group; 1 with *gid set, else 0. Fields are
 * split in place on a private copy, so a crafted line (missing fields, a
 * gid that is not a number or out of range) is skipped, never half-read.
 */
static int lookup_group_name(const char *name, gid_t *gid)
{
    char *text = read_small_file("/etc/group"), *save = NULL;
    int found = 0;
    if (!text)
        return 0;
    for (char *line = strtok_r(text, "\n", &save); line && !found; line = strtok_r(NULL, "\n", &save)) {
        char *f[4];
        uint64_t g;
        if (split_fields(line, f, 4) < 3 || parse_u64(f[2], UINT32_MAX - 1, &g))
            continue;
        if (strcmp(f[0], name) == 0) {
            *gid = (gid_t)g;
            found = 1;
        }
    }
    free(text);
    return found;
}

/* Supplementary groups: every /etc/group entry listing the user, plus the primary group. */
static void lookup_groups(struct identity *id)
{
    id->groups[id->ngroups++] = id->gid;
    char *text = id->name ? read_small_file("/etc/group") : NULL, *save = NULL;
    if (!text)
        return;
    for (char *line = strtok_r(text, "\n", &save); line && id->ngroups < MAX_GROUPS;
         line = strtok_r(NULL, "\n", &save)) {
        char *f[4], *msave = NULL;
        uint64_t g;
        if (split_fields(line, f, 4) < 4 || parse_u64(f[2], UINT32_MAX - 1, &g) || g == id->gid)
            continue;
        for (char *mem = strtok_r(f[3], ",", &msave); mem; mem = strtok_r(NULL, ",", &msave)) {
            if (strcmp(mem, id->name) == 0) {
                id->groups[id->ngroups++] = (gid_t)g;
                break;
            }
        }
    }
    free(text);
}

/*
 * `user` is USER[:GROUP], each a name or a number (docker's --user). 0, or
 * -1 for a user name the sandbox does not define, -2 for a group name.
 *
 * `root` is uid 0 even where /etc/passwd lacks it or is missing (a FROM
 * scratch image): it is the platform's default user and stands for what
 * `docker run` does without --user, uid 0 with gid 0. Any other name must be
 * in the sandbox's /etc/passwd; a numeric uid always works (within the
 * sandbox's ids), its passwd entry only supplying HOME and USER.
 */
static int resolve_identity(const struct spawn_request *req, struct command *cmd)
{
    struct identity *id = &cmd->id;
    *id = (struct identity){ .uid = req->uid, .gid = req->gid };
    uint64_t num;
    char user[128];
    const char *group = NULL;
    if (strlen(req->user) >= sizeof user)
        return -1;
    strcpy(user, req->user);
    char *colon = strchr(user, ':');
    if (colon) {
        *colon = 0;
        group = colon + 1;
        if (!user[0] || !group[0])
            return -1;
    }
    if (!user[0]) {
        struct identity found = *id;
        if (lookup_passwd(NULL, req->uid, &found, &cmd->passwd)) { /* only for HOME/USER/cwd defaults */
            id->name = found.name;
            id->home = found.home;
        }
    } else if (!parse_u64(user, UINT32_MAX - 1, &num)) {
        id->uid = id->gid = (uid_t)num;
        lookup_passwd(NULL, id->uid, id, &cmd->passwd);
    } else if (!lookup_passwd(user, 0, id, &cmd->passwd)) {
        if (strcmp(user, "root") != 0)
            return -1;
        id->uid = 0;
        id->gid = 0;
        id->name = "root";
        id->home = "/root";
    }
    if (group) {
        gid_t gid = 0;
        if (!parse_u64(group, UINT32_MAX - 1, &num))
            gid = (gid_t)num;
        else if (!lookup_group_name(group, &gid) && strcmp(group, "root") != 0)
            return -2; /* `root` is gid 0 without an /etc/group, as user root is uid 0 */
        id->gid = gid;
    }
    lookup_groups(id);
    return 0;
}

static int env_has(char **envp, const char *key)
{
    size_t n = strlen(key);
    for (; *envp; envp++)
        if (strncmp(*envp, key, n) == 0 && (*envp)[n] == '=')
            return 1;
    return 0;
}

/*
 * Resolves the user and builds the environment; 0, or -errno with `why`
 * filled in. A user the sandbox cannot run as (no such name in its
 * /etc/passwd, or a uid outside its id range: see switch_identity) is ESRCH,
 * as getpwnam(3) reports a missing entry, so the edge can name the field.
 */
static int prepare_command(const struct spawn_request *req, struct command *cmd, char *why, size_t whylen)
{
    *cmd = (struct command){ .req = req };
    int who = resolve_identity(req, cmd);
    if (who < 0) {
        snprintf(why, whylen, who == -2 ? "unknown group in %s" : "unknown user %s", req->user);
        return -ESRCH;
    }
    size_t n = 0;
    while (req->envp[n])
        n++;
    if (!(cmd->env = calloc(n + 3, sizeof *cmd->env))) {
        snprintf(why, whylen, "environment");
        return -ENOMEM;
    }
    memcpy(cmd->env, req->envp, n * sizeof *cmd->env);
    const struct identity *id = &cmd->id;
    if (id->home && !env_has(req->envp, "HOME") && asprintf(&cmd->home_var, "HOME=%s", id->home) > 0)
        cmd->env[n++] = cmd->home_var;
    if (id->name && !env_has(req->envp, "USER") && asprintf(&cmd->user_var, "USER=%s", id->name) > 0)
        cmd->env[n++] = cmd->user_var;
    return 0;
}

static void free_command(struct command *cmd)
{
    free(cmd->passwd);
    free(cmd->env);
    free(cmd->home_var);
    free(cmd->user_var);
}

static void switch_identity(const struct identity *id)
{
    /* setgroups is refused where the sandbox's user namespace denies it; then groups stay empty. */
    /* EINVAL (here and below): an id not mapped in the sandbox's user namespace (outside its range). */
    if (setgroups((size_t)id->ngroups, id->groups) < 0 && errno != EPERM)
        child_fail(errno == EINVAL ? ESRCH : errno, "setgroups%s: a group is outside the sandbox's ids", "");
    if (setresgid(id->gid, id->gid, id->gid) < 0)
        child_fail(errno == EINVAL ? ESRCH : errno, "setgid %s: the group is outside the sandbox's ids",
                   id->name ? id->name : "");
    if (setresuid(id->uid, id->uid, id->uid) < 0)
        child_fail(errno == EINVAL ? ESRCH : errno, "setuid %s: the user is outside the sandbox's ids",
                   id->name ? id->name : "");
}

/* execvpe() with the PATH taken from the command's environment, not ours. */
static _Noreturn void exec_path(char **argv, char **env)
{
    const char *file = argv[0];
    if (strchr(file, '/')) {
        execve(file, argv, env);
        child_fail(errno, "exec %s", file);
    }
    const char *path = DEFAULT_PATH;
    for (char **e = env; *e; e++)
        if (strncmp(*e, "PATH=", 5) == 0)
            path = *e + 5;
    int err = ENOENT;
    char full[4096];
    for (const char *dir = path;; dir++) {
        const char *colon = strchrnul(dir, ':');
        int len = (int)(colon - dir);
        if (snprintf(full, sizeof full, "%.*s%s%s", len, dir, len ? "/" : "", file) < (int)sizeof full) {
            execve(full, argv, env);
            if (errno == EACCES)
                err = EACCES; /* remembered, as execvp does; keep searching */
            else if (errno != ENOENT && errno != ENOTDIR)
                child_fail(errno, "exec %s", full);
        }
        if (!*colon)
            break;
        dir = colon;
    }
    child_fail(err, "exec %s", file);
}

void reaper_default_signals(void)
{
    for (int sig = 1; sig < NSIG; sig++)
        signal(sig, SIG_DFL);
}

/* The reaper's child: allocates nothing (under vfork it runs on the reaper's memory). */
static _Noreturn void run_command(const struct command *cmd)
{
    const struct spawn_request *req = cmd->req;
    /* Undo what the daemon set for itself: ignored signals survive exec, and the daemon
       ignores only these two (reaper_default_signals). */
    signal(SIGPIPE, SIG_DFL);
    signal(SIGCHLD, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);

    /* Its own process group (SIGNAL targets it); a pty also needs its own session. */
    if (req->flags & SPAWN_PTY) {
        if (setsid() < 0 || ioctl(0, TIOCSCTTY, 0) < 0)
            child_fail(errno, "set controlling terminal%s", "");
    } else if (setpgid(0, 0) < 0) {
        child_fail(errno, "setpgid%s", "");
    }

    const struct identity *id = &cmd->id;
    switch_identity(id);
    /* An explicit cwd must exist; a home that does not falls back to "/", as login does. */
    const char *cwd = req->cwd[0] ? req->cwd : id->home && id->home[0] ? id->home : "/";
    if (chdir(cwd) < 0 && (req->cwd[0] || chdir("/") < 0))
        child_fail(errno, "chdir %s", cwd);
    if (req->flags & SPAWN_SHELL) {
        fexecve(FD_SHELL, req->argv, cmd->env);
        child_fail(errno, "exec platform shell%s", "");
    }
    exec_path(req->argv, cmd->env);
}

/* ---- the reaper ---- */

/*
 * Moves the channels to the fixed layout and closes every other fd from
 * `first_closed` up: a new reaper closes what it inherited from the daemon
 * (FD_SIGNAL included, made after), a reused one keeps its signalfd.
 */
static void arrange_fds(const struct reaper_fds *f, int first_closed)
{
    int empty[2] = { -1, -1 };
    if (f->stdin_r < 0 && pipe2(empty, O_CLOEXEC) < 0) /* stdin at EOF, without trusting the sandbox's /dev/null */
        _exit(1);
    /* The shell stays at FD_SHELL for every command (CLOEXEC: only fexecve uses it). */
    int src[5] = { f->stdin_r >= 0 ? f->stdin_r : empty[0], f->stdout_w, f->stderr_w, f->ctl, f->shell_memfd };
    int tmp[5];
    for (int i = 0; i < 5; i++) /* above the targets first, so no dup2 below clobbers a source */
        if ((tmp[i] = src[i] < 0 ? -1 : fcntl(src[i], F_DUPFD_CLOEXEC, 10)) < 0 && src[i] >= 0)
            _exit(1);
    for (int i = 0; i < 5; i++) {
        if (tmp[i] < 0)
            close(i); /* whatever was there must not stay */
        else if (dup3(tmp[i], i, i <= 2 ? 0 : O_CLOEXEC) < 0)
            _exit(1);
    }
    syscall(SYS_close_range, first_closed, ~0u, 0);
}

/* SIGKILLs the command's group, then every child (orphans land here) until none is left. */
static void kill_tree(pid_t main, int *main_status, struct rusage *main_ru)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/self/task/%ld/children", (long)syscall(SYS_gettid));
    kill(-main, SIGKILL);
    for (;;) {
        FILE *f = fopen(path, "re");
        long pid;
        while (f && fscanf(f, "%ld", &pid) == 1)
            kill((pid_t)pid, SIGKILL);
        if (f)
            fclose(f);
        int st;
        struct rusage ru;
        pid_t w = wait4(-1, &st, 0, &ru);
        if (w < 0 && errno == ECHILD)
            return;
        if (w == main) {
            *main_status = st;
            *main_ru = ru;
        }
    }
}

/* Starts the command; returns its pid, or -1 after reporting SPAWN_ERROR. */
static pid_t start_command(const struct spawn_request *req)
{
    char why[REAPER_MSG_MAX - 8];
    struct command cmd;
    int r = prepare_command(req, &cmd, why, sizeof why);
    if (r < 0) {
        free_command(&cmd);
        send_spawn_error(-r, why);
        return -1;
    }
    struct reclaim_stats stats = { 0 };
    struct spawn_failure failure = { 0 };
    /*
     * vfork: the command borrows our memory until its exec instead of copying
     * our page tables, then faulting on and tearing down the copy (about a
     * sixth of the sandbox's CPU per short command). We stay suspended until it
     * execs or exits; run_command never returns, allocates nothing, and no
     * signal handler of ours can run in it (SIGCHLD is blocked, the rest are
     * default). A refused vfork (the pids limit, or a filter without vfork)
     * falls back to the fork that reclaims processes first.
     */
    vfork_failure.err = 0;
    err_pipe_w = -1;
    pid_t pid = vfork();
    if (pid == 0)
        run_command(&cmd);
    int fork_err = errno;
    __asm__ volatile("" ::: "memory"); /* the child may have written vfork_failure: read it anew */
    if (pid > 0 && vfork_failure.err) {
        failure = vfork_failure;
    } else if (pid < 0) {
        int ep[2];
        if (pipe2(ep, O_CLOEXEC) < 0) {
            free_command(&cmd);
            send_spawn_error(errno, "error pipe");
            return -1;
        }
        err_pipe_w = ep[1];
        pid = fork_reclaiming(&stats);
        if (pid == 0)
            run_command(&cmd);
        fork_err = errno;
        close(ep[1]);
        err_pipe_w = -1;
        if (pid > 0 && read(ep[0], &failure, sizeof failure - 1) <= 0)
            failure.err = 0; /* EOF: it exec'd */
        close(ep[0]);
    }
    free_command(&cmd);
    /* Only the command holds its stdio now, so the daemon sees EOF when it is done. */
    syscall(SYS_close_range, 0, 2, 0);
    if (pid < 0) {
        send_spawn_error(fork_err, fork_err == EAGAIN ? "fork: the sandbox's process limit is reached" : "fork");
        return -1;
    }
    if (failure.err) { /* exec did not happen: report the errno, not an exit code */
        waitpid(pid, NULL, 0);
        send_spawn_error(failure.err, failure.text);
        return -1;
    }
    unsigned char started[1 + STARTED_PAYLOAD] = { F_STARTED };
    put_u32(started + 1, (uint32_t)pid);
    put_u32(started + 5, stats.killed);
    put_u32(started + 9, stats.groups);
    send_msg(started, sizeof started);
    return pid;
}

/*
 * What a command inherits from its reaper and a process of the sandbox's
 * user could change from outside (prlimit, renice, chrt, taskset, ionice):
 * taken when the reaper starts, compared before it offers to run another.
 */
struct posture {
    struct rlimit limits[RLIM_NLIMITS];
    int nice, policy, ioprio;
    cpu_set_t cpus;
};

static void take_posture(struct posture *p)
{
    memset(p, 0, sizeof *p);
    for (int i = 0; i < RLIM_NLIMITS; i++)
        getrlimit(i, &p->limits[i]);
    errno = 0;
    p->nice = getpriority(PRIO_PROCESS, 0);
    p->policy = sched_getscheduler(0);
    p->ioprio = (int)syscall(SYS_ioprio_get, 1 /* IOPRIO_WHO_PROCESS */, 0);
    sched_getaffinity(0, sizeof p->cpus, &p->cpus);
}

/* Whether nothing a command inherits from this reaper changed since it started. */
static int posture_unchanged(const struct posture *first)
{
    struct posture now;
    take_posture(&now);
    return memcmp(&now, first, sizeof now) == 0;
}

/* Whether the command's tree left nothing behind (zombies of it are reaped here). */
static int no_children(void)
{
    for (;;) {
        pid_t w = waitpid(-1, NULL, WNOHANG);
        if (w > 0)
            continue;
        return w < 0 && errno == ECHILD;
    }
}

/*
 * Runs one command to its end and reports it; returns whether this reaper
 * offered to run another (it did if the command ended by itself, left no
 * process behind, and the daemon is still there).
 */
static int run_one(const struct spawn_request *req, const struct posture *posture)
{
    pid_t main = start_command(req);
    if (main < 0)
        return 0;
    int status = 0, done = 0, killing = 0;
    struct rusage ru = { 0 };
    struct pollfd p[2] = { { .fd = FD_SIGNAL, .events = POLLIN }, { .fd = FD_CTL, .events = POLLIN } };
    while (!done && !killing) {
        if (poll(p, 2, -1) < 0 && errno != EINTR)
            break;
        struct signalfd_siginfo si;
        while (read(FD_SIGNAL, &si, sizeof si) > 0)
            ;
        int st;
        struct rusage r;
        pid_t w;
        while ((w = wait4(-1, &st, WNOHANG, &r)) > 0) {
            if (w == main) {
                status = st;
                ru = r;
                done = 1;
            }
        }
        if (!(p[1].revents & (POLLIN | POLLHUP | POLLERR)))
            continue;
        unsigned char msg[8];
        ssize_t n = recv(FD_CTL, msg, sizeof msg, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
            /* The daemon is gone, or dropped the client: a detached command lives on. */
            if (req->flags & SPAWN_DETACHED)
                p[1].fd = -1;
            else
                killing = 1;
        } else if (n == 5 && msg[0] == F_SIGNAL) {
            kill(-main, (int)get_u32(msg + 1));
        } else if (n >= 1 && msg[0] == F_KILL_TREE) {
            killing = 1;
        }
    }
    if (killing)
        kill_tree(main, &status, &ru);
    int reusable = done && !killing && p[1].fd >= 0 && !(req->flags & (SPAWN_PTY | SPAWN_DETACHED)) &&
                   no_children() && posture_unchanged(posture);
    send_exit(status, &ru, reusable);
    return reusable;
}

/*
 * Waits, idle, for the daemon's next command: REAPER_RUN with the SPAWN
 * payload, and the command's pipes attached (stdin's read end first when
 * SPAWN_STDIN, then stdout's and stderr's write ends). Stale SIGNAL and
 * KILL_TREE messages for the last command are skipped. Exits when the
 * daemon closes the channel (it no longer wants this reaper).
 */
static struct spawn_request *next_command(struct reaper_fds *f)
{
    static unsigned char *buf;
    if (!buf && !(buf = malloc(1 + REAPER_RUN_MAX + 1)))
        _exit(1);
    for (;;) {
        union {
            struct cmsghdr h;
            char space[CMSG_SPACE(3 * sizeof(int))];
        } control;
        struct iovec iov = { .iov_base = buf, .iov_len = 1 + REAPER_RUN_MAX + 1 };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = &control, .msg_controllen = sizeof control };
        ssize_t n = recvmsg(FD_CTL, &mh, MSG_CMSG_CLOEXEC);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            _exit(0);
        int fds[3], nfds = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                continue;
            int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < k; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
                if (nfds < 3)
                    fds[nfds++] = fd;
                else
                    close(fd);
            }
        }
        struct spawn_request *req = NULL;
        if (buf[0] == REAPER_RUN && !(mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) && (req = malloc(sizeof *req)) &&
            spawn_request_parse(buf + 1, (size_t)n - 1, req) == 0) {
            int want = req->flags & SPAWN_STDIN ? 3 : 2;
            if (nfds == want && !(req->flags & (SPAWN_PTY | SPAWN_DETACHED))) {
                *f = (struct reaper_fds){ .ctl = FD_CTL, .stdin_r = want == 3 ? fds[0] : -1,
                                          .stdout_w = fds[want - 2], .stderr_w = fds[want - 1],
                                          .shell_memfd = FD_SHELL };
                return req;
            }
            spawn_request_free(req);
        }
        free(req);
        for (int i = 0; i < nfds; i++)
            close(fds[i]);
        if (buf[0] == REAPER_RUN)
            _exit(1); /* a command we cannot run: the daemon reports the reaper gone */
    }
}

_Noreturn void reaper_main(const struct spawn_request *req, const struct reaper_fds *fds)
{
    signal(SIGCHLD, SIG_DFL); /* the daemon ignores it; we need wait statuses */
    /* Visible inside the sandbox: show no host paths. */
    set_process_title("dsec-reaper");
    prctl(PR_SET_NAME, "dsec-reaper", 0, 0, 0);
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    setsid();
    /* Commands start at nice 0, not at the daemon's PLATFORM_NICE (chronus.h). */
    struct sched_param param = { 0 };
    int policy = sched_getscheduler(0);
    if (policy >= 0 && sched_getparam(0, &param) == 0)
        (void)!sched_setscheduler(0, policy | SCHED_RESET_ON_FORK, &param);
    arrange_fds(fds, FD_SIGNAL);
    struct posture posture;
    take_posture(&posture);
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0 || (sfd != FD_SIGNAL && (dup3(sfd, FD_SIGNAL, O_CLOEXEC) < 0 || close(sfd) < 0)))
        _exit(1);
    if (!run_one(req, &posture))
        _exit(0);
    for (;;) {
        struct reaper_fds next_fds;
        struct spawn_request *next = next_command(&next_fds);
        arrange_fds(&next_fds, FD_SIGNAL + 1);
        int again = run_one(next, &posture);
        spawn_request_free(next);
        free(next);
        if (!again)
            _exit(0);
    }
}
