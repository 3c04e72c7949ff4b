/*
 * confine: the one way the platform runs a program over a directory tree a
 * sandbox made (its writable layer, a copy of it, a layer built from one).
 *
 * The program runs in a mount namespace of its own whose root is an empty,
 * read-only tmpfs holding only the trees it is given, each attached under a
 * fixed name with nosymfollow, nosuid, nodev and noexec. So:
 *   - no symlink on a sandbox tree is followed by any path lookup, in any
 *     component (the kernel answers ELOOP), whatever the program does;
 *   - an absolute path, a `..` or a link target the program could be steered
 *     to ends inside this root, which holds nothing of the host but the
 *     read-only /usr of `--tools`;
 *   - the old root is detached, no /dev is mounted, every fd but 0-2 is
 *     closed at exec, and no_new_privs is set;
 *   - the program runs in a pid namespace of its own, under a small init
 *     (this helper) that ends everything it started when it ends; its /proc
 *     holds only those processes (subset=pid: no /proc/sys, no host pid).
 *     Tools need that much /proc: glibc changes a mode without following a
 *     link (cp -a on a directory it made writable) through /proc/self/fd.
 * With `--ns PID` the program runs in the mount namespace and root of that
 * process instead (a sandbox's own view), for what must act on the sandbox's
 * live tree as the sandbox sees it.
 *
 * Usage:
 *   dsec-helper confine --root DIR [--ro SRC NAME]... [--rw SRC NAME]...
 *       [--ext4 DEV NAME] [--tools] [--cwd NAME] [--cgroup DIR]...
 *       [--max-file-bytes N] [--max-cpu-seconds N] [--stack-bytes N] [--self] -- PROGRAM ARG...
 *   dsec-helper confine --ns PID [--cgroup DIR]... --self -- ARG...
 *
 * --root DIR   an empty, platform-made directory; the private root is mounted
 *              on it (in the private namespace only: the host sees nothing).
 * --ro/--rw    attach the tree SRC (a platform-made path; its own mount only,
 *              no submounts) at /NAME, read-only or writable.
 * --ext4 DEV   mount the ext4 device DEV (a sandbox's disk-quota image, whose
 *              superblock is already mounted: this shares it) read-only at /NAME.
 * --tools      /usr read-only, and the merged-usr links (/bin, /lib...), so a
 *              dynamically linked host tool (cp, mkfs.erofs) can run.
 * --cgroup DIR join this cgroup first (one per v1 hierarchy).
 * --self       PROGRAM is this helper, run from an fd opened before the root
 *              changed (it is static: it needs nothing in the new root).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <signal.h>
#include <unistd.h>

#include "cmds.h"
#include "util.h"

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

#define MAX_TREES 160
#define MAX_CGROUPS 16

struct tree {
    const char *src, *name;
    int writable;
};

struct confine_args {
    const char *root, *ext4_dev, *ext4_name, *cwd;
    struct tree trees[MAX_TREES];
    int ntrees;
    const char *cgroups[MAX_CGROUPS];
    int ncgroups;
    int tools, self;
    long ns_pid;
    uint64_t max_file_bytes, max_cpu_seconds, stack_bytes;
    char **argv; /* after "--" */
};

/* A name in the private root: one plain component. */
static void check_name(const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n > 64 || strcmp(name, ".") == 0 || strcmp(name, "..") == 0)
        dief(EINVAL, "confine: bad name %s", name);
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-'))
            dief(EINVAL, "confine: bad name %s", name);
    }
    static const char *reserved[] = { "usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32" };
    for (size_t i = 0; i < sizeof reserved / sizeof reserved[0]; i++)
        if (strcmp(name, reserved[i]) == 0)
            dief(EINVAL, "confine: name %s is reserved for --tools", name);
}

static uint64_t number(const char *opt, const char *val)
{
    uint64_t v;
    if (parse_u64(val, UINT64_MAX / 2, &v))
        dief(EINVAL, "confine: %s %s", opt, val);
    return v;
}

static void parse_args(int argc, char **argv, struct confine_args *a)
{
    for (int i = 0; i < argc; i++) {
        const char *opt = argv[i];
        if (strcmp(opt, "--") == 0) {
            a->argv = argv + i + 1;
            break;
        }
        if (strcmp(opt, "--tools") == 0) {
            a->tools = 1;
            continue;
        }
        if (strcmp(opt, "--self") == 0) {
            a->self = 1;
            continue;
        }
        int two = strcmp(opt, "--ro") == 0 || strcmp(opt, "--rw") == 0 || strcmp(opt, "--ext4") == 0;
        if (i + 1 + two >= argc)
            dief(EINVAL, "confine: %s needs %s", opt, two ? "two values" : "a value");
        const char *val = argv[++i];
        if (two) {
            const char *name = argv[++i];
            check_name(name);
            if (strcmp(opt, "--ext4") == 0) {
                a->ext4_dev = val;
                a->ext4_name = name;
            } else {
                if (a->ntrees == MAX_TREES)
                    dief(E2BIG, "confine: at most %d trees", MAX_TREES);
                a->trees[a->ntrees++] = (struct tree){ val, name, opt[3] == 'w' };
            }
        } else if (strcmp(opt, "--root") == 0)
            a->root = val;
        else if (strcmp(opt, "--cwd") == 0)
            a->cwd = val;
        else if (strcmp(opt, "--cgroup") == 0) {
            if (a->ncgroups == MAX_CGROUPS)
                dief(E2BIG, "confine: at most %d cgroups", MAX_CGROUPS);
            a->cgroups[a->ncgroups++] = val;
        } else if (strcmp(opt, "--ns") == 0)
            a->ns_pid = (long)number(opt, val);
        else if (strcmp(opt, "--max-file-bytes") == 0)
            a->max_file_bytes = number(opt, val);
        else if (strcmp(opt, "--max-cpu-seconds") == 0)
            a->max_cpu_seconds = number(opt, val);
        else if (strcmp(opt, "--stack-bytes") == 0)
            a->stack_bytes = number(opt, val);
        else
            dief(EINVAL, "confine: unknown option %s", opt);
    }
    if (!a->argv || !a->argv[0])
        dief(EINVAL, "usage: confine --root DIR [--ro|--rw SRC NAME]... [--ext4 DEV NAME] [--tools] "
                     "[--cwd NAME] [--cgroup DIR]... [--max-file-bytes N] [--self] -- PROGRAM ARG...");
    if (a->ns_pid) {
        if (a->root || a->ntrees || a->ext4_dev || a->tools || a->cwd || !a->self)
            dief(EINVAL, "confine: --ns takes only --cgroup, limits and --self");
    } else if (!a->root)
        dief(EINVAL, "confine: --root is required");
}

static void join_cgroups(const struct confine_args *a)
{
    char pid[32];
    snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    for (int i = 0; i < a->ncgroups; i++) {
        char path[PATH_MAX];
        if ((size_t)snprintf(path, sizeof path, "%s/cgroup.procs", a->cgroups[i]) >= sizeof path)
            dief(ENAMETOOLONG, "confine: cgroup %s", a->cgroups[i]);
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        if (fd < 0)
            dief(errno, "confine: open %s", path);
        int r = write_all(fd, pid, strlen(pid));
        close(fd);
        if (r < 0)
            dief(-r, "confine: join %s", a->cgroups[i]);
    }
}

static void set_limit(int resource, uint64_t value, const char *what)
{
    struct rlimit rl = { (rlim_t)value, (rlim_t)value };
    struct rlimit cur;
    /* Never above the hard limit we have (root here lacks CAP_SYS_RESOURCE). */
    if (getrlimit(resource, &cur) == 0 && cur.rlim_max != RLIM_INFINITY && rl.rlim_max > cur.rlim_max)
        rl.rlim_cur = rl.rlim_max = cur.rlim_max;
    if (setrlimit(resource, &rl) < 0)
        dief(errno, "confine: setrlimit %s", what);
}

/* Attaches a clone of `src` (its own mount only) at root/name with `attrs`. */
static void attach(int rootfd, const char *src, const char *name, uint64_t attrs, int recursive)
{
    int tree = open_tree(AT_FDCWD, src,
                         OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_SYMLINK_NOFOLLOW |
                             (recursive ? AT_RECURSIVE : 0));
    if (tree < 0)
        dief(errno, "confine: open_tree %s", src);
    struct mount_attr attr = { .attr_set = attrs };
    if (mount_setattr(tree, "", AT_EMPTY_PATH | (recursive ? AT_RECURSIVE : 0), &attr, sizeof attr) < 0)
        dief(errno, "confine: mount_setattr %s", src);
    if (mkdirat(rootfd, name, 0755) < 0)
        dief(errno, "confine: mkdir /%s", name);
    if (move_mount(tree, "", rootfd, name, MOVE_MOUNT_F_EMPTY_PATH) < 0)
        dief(errno, "confine: attach %s at /%s", src, name);
    close(tree);
}

/* /usr read-only, and each top-level merged-usr entry as the host has it (a link, or a bind). */
static void attach_tools(int rootfd)
{
    const uint64_t ro = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
    attach(rootfd, "/usr", "usr", ro, 1);
    static const char *tops[] = { "bin", "sbin", "lib", "lib32", "lib64", "libx32" };
    for (size_t i = 0; i < sizeof tops / sizeof tops[0]; i++) {
        char path[16], target[PATH_MAX];
        snprintf(path, sizeof path, "/%s", tops[i]);
        struct stat st;
        if (lstat(path, &st) < 0)
            continue;
        if (S_ISLNK(st.st_mode)) {
            ssize_t n = readlink(path, target, sizeof target - 1);
            if (n < 0)
                dief(errno, "confine: readlink %s", path);
            target[n] = 0;
            if (symlinkat(target, rootfd, tops[i]) < 0)
                dief(errno, "confine: symlink /%s", tops[i]);
        } else if (S_ISDIR(st.st_mode))
            attach(rootfd, path, tops[i], ro, 1);
    }
}

static void make_private_root(const struct confine_args *a)
{
    if (unshare(CLONE_NEWNS) < 0)
        die("confine: unshare(CLONE_NEWNS)", errno);
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        die("confine: make / private", errno);
    if (mount("dsec-confine", a->root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
              "size=64k,nr_inodes=64,mode=0755") < 0)
        dief(errno, "confine: mount tmpfs on %s", a->root);
    int rootfd = open(a->root, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (rootfd < 0)
        dief(errno, "confine: open %s", a->root);

    const uint64_t tree_attrs =
        MOUNT_ATTR_NOSYMFOLLOW | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC;
    for (int i = 0; i < a->ntrees; i++)
        attach(rootfd, a->trees[i].src, a->trees[i].name,
               tree_attrs | (a->trees[i].writable ? 0 : MOUNT_ATTR_RDONLY), 0);
    if (a->ext4_dev) {
        if (mkdirat(rootfd, a->ext4_name, 0755) < 0)
            dief(errno, "confine: mkdir /%s", a->ext4_name);
        char target[PATH_MAX];
        if ((size_t)snprintf(target, sizeof target, "%s/%s", a->root, a->ext4_name) >= sizeof target)
            dief(ENAMETOOLONG, "confine: %s", a->root);
        /* The superblock is mounted read-write in the sandbox's namespace: this
         * mount shares it (a read-only mount of it would be EBUSY), and is made
         * read-only itself right after. */
        if (mount(a->ext4_dev, target, "ext4", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOSYMFOLLOW, NULL) < 0)
            dief(errno, "confine: mount ext4 %s", a->ext4_dev);
        struct mount_attr attr = { .attr_set = MOUNT_ATTR_RDONLY | tree_attrs };
        if (mount_setattr(rootfd, a->ext4_name, 0, &attr, sizeof attr) < 0)
            dief(errno, "confine: read-only %s", a->ext4_dev);
    }
    if (a->tools)
        attach_tools(rootfd);
    if (mkdirat(rootfd, "proc", 0555) < 0)
        die("confine: mkdir /proc", errno);

    /* pivot_root(".", "."): the old root ends up stacked under the new one, then detached. */
    if (fchdir(rootfd) < 0)
        die("confine: chdir to the new root", errno);
    if (syscall(SYS_pivot_root, ".", ".") < 0)
        die("confine: pivot_root", errno);
    if (umount2(".", MNT_DETACH) < 0)
        die("confine: detach the old root", errno);
    if (chdir("/") < 0)
        die("confine: chdir /", errno);
    /* This process is pid 1 of its own pid namespace: the /proc it mounts shows that namespace only. */
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "subset=pid") < 0)
        die("confine: mount /proc", errno);
    struct mount_attr ro = { .attr_set = MOUNT_ATTR_RDONLY };
    if (mount_setattr(AT_FDCWD, "/", 0, &ro, sizeof ro) < 0)
        die("confine: read-only root", errno);
    close(rootfd);
    if (a->cwd && chdir(a->cwd) < 0)
        dief(errno, "confine: chdir %s", a->cwd);
}

/* The sandbox's own view: its mount namespace, and its root inside it. */
static void enter_namespace(long pid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%ld/ns/mnt", pid);
    int ns = open(path, O_RDONLY | O_CLOEXEC);
    if (ns < 0)
        dief(errno, "confine: open %s", path);
    snprintf(path, sizeof path, "/proc/%ld/root", pid);
    int root = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (root < 0)
        dief(errno, "confine: open %s", path);
    if (setns(ns, CLONE_NEWNS) < 0)
        die("confine: setns(mnt)", errno);
    if (fchdir(root) < 0 || chroot(".") < 0 || chdir("/") < 0)
        die("confine: enter the sandbox's root", errno);
    close(ns);
    close(root);
}

/* Ends this process the way a wait status says its program ended. */
static _Noreturn void exit_like(int status)
{
    if (WIFEXITED(status))
        _exit(WEXITSTATUS(status));
    int sig = WIFSIGNALED(status) ? WTERMSIG(status) : SIGKILL;
    struct rlimit none = { 0, 0 };
    setrlimit(RLIMIT_CORE, &none);
    signal(sig, SIG_DFL);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, sig);
    sigprocmask(SIG_UNBLOCK, &set, NULL);
    raise(sig);
    _exit(128 + sig);
}

/*
 * Returns in pid 1 of a new pid namespace, with the write end of a pipe on
 * which it sends the program's wait status. The caller's own process stays
 * outside, waits, and ends as the program did (exit code or signal), so the
 * platform sees the program's status.
 */
static int enter_pid_namespace(void)
{
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) < 0)
        die("confine: pipe", errno);
    if (unshare(CLONE_NEWPID) < 0)
        die("confine: unshare(CLONE_NEWPID)", errno);
    pid_t init = fork();
    if (init < 0)
        die("confine: fork", errno);
    if (init == 0) {
        close(fds[0]);
        if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0)
            die("confine: PR_SET_PDEATHSIG", errno);
        return fds[1];
    }
    close(fds[1]);
    int status = 0, init_status = 0;
    ssize_t n;
    while ((n = read(fds[0], &status, sizeof status)) < 0 && errno == EINTR)
        ;
    while (waitpid(init, &init_status, 0) < 0)
        if (errno != EINTR)
            die("confine: waitpid", errno);
    exit_like(n == (ssize_t)sizeof status ? status : init_status);
}

/*
 * Pid 1: forks the program and returns in it; the init itself reaps whatever
 * ends, sends the program's status once it ends, and exits, which ends every
 * process left in the namespace.
 */
static void run_under_init(int status_fd)
{
    pid_t program = fork();
    if (program < 0)
        die("confine: fork", errno);
    if (program == 0) {
        close(status_fd);
        return;
    }
    for (;;) {
        int status;
        pid_t pid = wait(&status);
        if (pid == program) {
            ssize_t n = write(status_fd, &status, sizeof status);
            _exit(n == (ssize_t)sizeof status ? 0 : 1);
        }
        if (pid < 0 && errno != EINTR)
            die("confine: wait", errno);
    }
}

int cmd_confine(int argc, char **argv)
{
    struct confine_args a = { 0 };
    parse_args(argc, argv, &a);
    join_cgroups(&a);

    int self = -1;
    if (a.self && (self = open("/proc/self/exe", O_RDONLY | O_CLOEXEC)) < 0)
        die("confine: open /proc/self/exe", errno);
    if (a.ns_pid)
        enter_namespace(a.ns_pid);
    else {
        int status_fd = enter_pid_namespace();
        make_private_root(&a);
        run_under_init(status_fd);
    }

    set_limit(RLIMIT_CORE, 0, "RLIMIT_CORE");
    if (a.max_file_bytes)
        set_limit(RLIMIT_FSIZE, a.max_file_bytes, "RLIMIT_FSIZE");
    if (a.max_cpu_seconds)
        set_limit(RLIMIT_CPU, a.max_cpu_seconds, "RLIMIT_CPU");
    if (a.stack_bytes) {
        struct rlimit cur;
        if (getrlimit(RLIMIT_STACK, &cur) == 0) {
            cur.rlim_cur = (rlim_t)a.stack_bytes;
            if (cur.rlim_max != RLIM_INFINITY && cur.rlim_cur > cur.rlim_max)
                cur.rlim_cur = cur.rlim_max;
            if (setrlimit(RLIMIT_STACK, &cur) < 0)
                die("confine: setrlimit RLIMIT_STACK", errno);
        }
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        die("confine: no_new_privs", errno);
    if (syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC) < 0)
        die("confine: close_range", errno);

    static char *env[] = { "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C", NULL };
    if (a.self) {
        /* argv[0] stays the helper's name; the rest is its subcommand. */
        char **args = a.argv - 1;
        args[0] = "dsec-helper";
        fexecve(self, args, env);
        die("confine: exec dsec-helper", errno);
    }
    /* execvpe searches the caller's PATH: make it the one the program gets. */
    if (setenv("PATH", env[0] + 5, 1) < 0)
        die("confine: setenv", errno);
    execvpe(a.argv[0], a.argv, env);
    dief(errno, "confine: exec %s", a.argv[0]);
}
