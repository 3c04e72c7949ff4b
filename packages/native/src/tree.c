/*
 * tree: the operations the platform performs on a directory tree a sandbox
 * made, written so that none of them can be steered out of it. Every path
 * below a tree's root is opened with openat2(RESOLVE_BENEATH |
 * RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV), and a walk
 * moves one component at a time (openat with O_NOFOLLOW | O_DIRECTORY from
 * the parent's fd): no symlink in any component is followed, no `..` leaves
 * the tree, no mount is crossed, and a directory swapped for a symlink
 * mid-walk makes that open fail instead of redirecting it. The caller runs
 * these inside `confine` as well (defence in depth), as `dsec-helper confine
 * ... --self -- tree OP ...`.
 *
 *   tree scan ROOT [--max-files N] [--max-bytes N] [--max-path N] [--max-depth N]
 *       Counts entries (every name below ROOT), bytes (apparent size of
 *       regular files, a hard-linked one once), holes (what of those bytes
 *       has no block behind it) and depth.
 *       Prints `files N`, `bytes N`, `holes N`, `depth N`; past a cap it
 *       stops, prints `over files|bytes|path|depth` first and exits 3.
 *   tree shadow [--lower DIR]... (--path REL | --subtree REL)...
 *       Prints the index of each pattern the lower layers (top first) show,
 *       looked up as overlayfs does (whiteouts, non-directories and opaque
 *       directories hide what is below them; a subtree must be a non-empty
 *       directory).
 *   tree scrub ROOT --host-id N [--lower DIR]... (--path REL | --subtree REL)...
 *       Removes what each pattern names from ROOT (a private copy of a
 *       writable layer) and, where a lower layer shows it, hides it: a
 *       whiteout for a path, the opaque mark for a subtree. Directories it
 *       must create take the mode and owner of the lower directory they stand
 *       over, shifted into the sandbox's host range (N). A pattern whose path
 *       passes through a symlink or a file in ROOT names nothing there (that
 *       entry already hides whatever a lower layer has below it): skipped.
 *   tree rm PATH
 *       Removes PATH and everything under it, at any depth, with bounded
 *       fds (too deep a directory is renamed up to PATH and removed from there).
 *   tree merge (--keep-marks | --strip-marks) TOP LOWER...
 *       Merges layer trees (topmost first) into TOP as overlayfs shows their
 *       stack, consuming the lower ones (collapse).
 *   tree chmod-node PATH MODE [--skip DEV:INO]
 *       Sets the mode (octal) of the character device PATH (relative to the root),
 *       unless it is the node DEV:INO (the host's own, bound in). Prints
 *       `changed`, `same`, `host`, or `absent`.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "cmds.h"
#include "util.h"

#ifndef SYS_fchmodat2
#define SYS_fchmodat2 452
#endif

#define MAX_PATTERNS 256
#define MAX_LOWERS 150
#define RM_MAX_DEPTH 128
#define EXIT_OVER 3

static const char OPAQUE_XATTR[] = "trusted.overlay.opaque";

/* ---- resolution ---- */

/* Opens REL below dirfd without following any symlink, crossing a mount or leaving the tree; '' is dirfd itself. */
static int open_resolved(int dirfd, const char *rel, int flags, uint64_t resolve)
{
    struct open_how how = {
        .flags = (uint64_t)(flags | O_CLOEXEC),
        .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | resolve,
    };
    long fd = syscall(SYS_openat2, dirfd, rel[0] ? rel : ".", &how, sizeof how);
    if (fd < 0 && errno == ENOSYS)
        die("openat2 (Linux 5.6 or later is needed)", ENOSYS);
    return (int)fd;
}

static int open_beneath(int dirfd, const char *rel, int flags)
{
    return open_resolved(dirfd, rel, flags, RESOLVE_NO_XDEV);
}

static int open_root(const char *path)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        dief(errno, "tree: open %s", path);
    return fd;
}

/* Splits REL into its parent (NUL-terminated copy in buf, '' for the top) and last name. */
static const char *split(const char *rel, char *buf, size_t size)
{
    const char *slash = strrchr(rel, '/');
    if (!slash) {
        buf[0] = 0;
        return rel;
    }
    size_t n = (size_t)(slash - rel);
    if (n >= size)
        dief(ENAMETOOLONG, "tree: %s", rel);
    memcpy(buf, rel, n);
    buf[n] = 0;
    return slash + 1;
}

static int is_whiteout(const struct stat *st)
{
    return S_ISCHR(st->st_mode) && st->st_rdev == makedev(0, 0);
}

/* ---- reading directories ---- */

/* A directory's entries read in one go: each is one type byte, the name, a NUL. */
struct names {
    char *buf;
    size_t len, cap, off;
};

static void names_add(struct names *n, unsigned char type, const char *name)
{
    size_t need = strlen(name) + 2;
    if (n->len + need > n->cap) {
        size_t cap = n->cap ? n->cap * 2 : 4096;
        while (cap < n->len + need)
            cap *= 2;
        char *b = realloc(n->buf, cap);
        if (!b)
            die("tree: realloc", ENOMEM);
        n->buf = b;
        n->cap = cap;
    }
    n->buf[n->len] = (char)type;
    memcpy(n->buf + n->len + 1, name, need - 1);
    n->len += need;
}

/* Next entry, or NULL; *type gets its d_type. */
static const char *names_next(struct names *n, unsigned char *type)
{
    if (n->off >= n->len)
        return NULL;
    *type = (unsigned char)n->buf[n->off];
    const char *name = n->buf + n->off + 1;
    n->off += strlen(name) + 2;
    return name;
}

struct linux_dirent64 {
    uint64_t d_ino;
    int64_t d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
};

/* Reads every entry of the open directory fd (but . and ..) into n; returns 0 or -errno. */
static int read_names(int fd, struct names *n)
{
    char buf[32768] __attribute__((aligned(8)));
    for (;;) {
        long got = syscall(SYS_getdents64, fd, buf, sizeof buf);
        if (got < 0)
            return -errno;
        if (got == 0)
            return 0;
        for (long off = 0; off < got;) {
            struct linux_dirent64 *d = (struct linux_dirent64 *)(buf + off);
            off += d->d_reclen;
            if (strcmp(d->d_name, ".") && strcmp(d->d_name, ".."))
                names_add(n, d->d_type, d->d_name);
        }
    }
}

static int nonempty_dir(int parentfd, const char *name)
{
    int fd = name ? openat(parentfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
                  : dup(parentfd);
    if (fd < 0)
        return 0;
    struct names n = { 0 };
    int r = read_names(fd, &n);
    close(fd);
    int any = r == 0 && n.len > 0;
    free(n.buf);
    return any;
}

/* ---- scan ---- */

struct scan_frame {
    int fd;
    struct names names;
    size_t pathlen;
};

/* Inode numbers of hard-linked files already counted: open addressing, grown at half full. */
struct ino_set {
    uint64_t *slots;
    size_t cap, used;
};

static int ino_seen(struct ino_set *s, uint64_t ino)
{
    if (ino == 0)
        ino = UINT64_MAX; /* 0 marks an empty slot */
    if (2 * (s->used + 1) > s->cap) {
        struct ino_set bigger = { calloc(s->cap ? s->cap * 2 : 1024, sizeof *s->slots),
                                  s->cap ? s->cap * 2 : 1024, 0 };
        if (!bigger.slots)
            die("tree: calloc", ENOMEM);
        for (size_t i = 0; i < s->cap; i++)
            if (s->slots[i])
                ino_seen(&bigger, s->slots[i]);
        free(s->slots);
        *s = bigger;
    }
    for (size_t i = (size_t)(ino * 0x9e3779b97f4a7c15ULL) & (s->cap - 1);; i = (i + 1) & (s->cap - 1)) {
        if (s->slots[i] == ino)
            return 1;
        if (s->slots[i] == 0) {
            s->slots[i] = ino;
            s->used++;
            return 0;
        }
    }
}

static int cmd_scan(int argc, char **argv)
{
    if (argc < 1)
        dief(EINVAL, "usage: tree scan ROOT [--max-files N] [--max-bytes N] [--max-path N] [--max-depth N]");
    uint64_t max_files = UINT64_MAX, max_bytes = UINT64_MAX, max_path = UINT64_MAX, max_depth = 4096;
    for (int i = 1; i < argc; i++) {
        uint64_t *slot = strcmp(argv[i], "--max-files") == 0   ? &max_files
                         : strcmp(argv[i], "--max-bytes") == 0 ? &max_bytes
                         : strcmp(argv[i], "--max-path") == 0  ? &max_path
                         : strcmp(argv[i], "--max-depth") == 0 ? &max_depth
                                                               : NULL;
        if (!slot || i + 1 >= argc || parse_u64(argv[i + 1], UINT64_MAX, slot))
            dief(EINVAL, "tree scan: bad option %s", argv[i]);
        i++;
    }
    if (max_depth > 16384)
        max_depth = 16384;
    struct scan_frame *stack = calloc((size_t)max_depth + 1, sizeof *stack);
    if (!stack)
        die("tree: calloc", ENOMEM);
    struct stat root_st;
    stack[0].fd = open_root(argv[0]);
    if (fstat(stack[0].fd, &root_st) < 0)
        die("tree scan: fstat", errno);
    int r = read_names(stack[0].fd, &stack[0].names);
    if (r < 0)
        dief(-r, "tree scan: read %s", argv[0]);

    uint64_t files = 0, bytes = 0, holes = 0, depth = 0;
    const char *over = NULL;
    struct ino_set seen = { 0 };
    size_t top = 0;
    while (!over) {
        struct scan_frame *f = &stack[top];
        unsigned char type;
        const char *name = names_next(&f->names, &type);
        if (!name) {
            close(f->fd);
            free(f->names.buf);
            memset(f, 0, sizeof *f);
            if (top == 0)
                break;
            top--;
            continue;
        }
        if (++files > max_files) {
            over = "files";
            break;
        }
        size_t pathlen = f->pathlen + 1 + strlen(name);
        if (pathlen > max_path) {
            over = "path";
            break;
        }
        struct stat st;
        if (type == DT_UNKNOWN) {
            if (fstatat(f->fd, name, &st, AT_SYMLINK_NOFOLLOW) < 0)
                continue;
            type = S_ISDIR(st.st_mode) ? DT_DIR : S_ISREG(st.st_mode) ? DT_REG : DT_UNKNOWN;
        }
        if (type == DT_DIR) {
            int fd = openat(f->fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (fd < 0)
                continue; /* swapped for something else meanwhile: it is counted, not entered */
            if (fstat(fd, &st) < 0 || st.st_dev != root_st.st_dev) {
                close(fd);
                continue; /* a mount point: not part of the tree */
            }
            if (top + 1 > max_depth) {
                close(fd);
                over = "depth";
                break;
            }
            top++;
            stack[top].fd = fd;
            stack[top].pathlen = pathlen;
            r = read_names(fd, &stack[top].names);
            if (r < 0)
                dief(-r, "tree scan: read a directory");
            if (top > depth)
                depth = top;
        } else if (type == DT_REG) {
            if (fstatat(f->fd, name, &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISREG(st.st_mode))
                continue;
            if (st.st_nlink > 1 && ino_seen(&seen, (uint64_t)st.st_ino))
                continue;
            bytes += (uint64_t)st.st_size;
            uint64_t backed = (uint64_t)st.st_blocks * 512;
            if ((uint64_t)st.st_size > backed)
                holes += (uint64_t)st.st_size - backed;
            if (bytes > max_bytes)
                over = "bytes";
        }
    }
    for (size_t i = 0; i <= top; i++) {
        if (stack[i].fd > 0)
            close(stack[i].fd);
        free(stack[i].names.buf);
    }
    free(stack);
    free(seen.slots);
    if (over)
        printf("over %s\n", over);
    printf("files %llu\nbytes %llu\nholes %llu\ndepth %llu\n", (unsigned long long)files,
           (unsigned long long)bytes, (unsigned long long)holes, (unsigned long long)depth);
    fflush(stdout);
    return over ? EXIT_OVER : 0;
}

/* ---- rm ---- */

struct rm_frame {
    int fd;
    struct names names;
    char name[NAME_MAX + 1]; /* this directory's name in its parent */
};

static int rm_first_error;

static void rm_note(int err, const char *what, const char *name)
{
    if (err == ENOENT)
        return;
    if (!rm_first_error) {
        char msg[NAME_MAX + 64];
        snprintf(msg, sizeof msg, "tree rm: %s %s", what, name);
        report_error(msg, err);
        rm_first_error = err;
    }
}

/*
 * Removes the directory `name` in parentfd and all it holds. Directories
 * deeper than RM_MAX_DEPTH are renamed up into the top directory (the one
 * being removed, so they stay inside what goes) and taken from there, which
 * keeps the fds in use bounded at any depth.
 */
static void rm_dir(int parentfd, const char *name)
{
    static struct rm_frame stack[RM_MAX_DEPTH];
    unsigned long renamed = 0;
    int top = 0;
    stack[0].fd = openat(parentfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (stack[0].fd < 0) {
        if (errno == ENOTDIR || errno == ELOOP) {
            if (unlinkat(parentfd, name, 0) < 0)
                rm_note(errno, "unlink", name);
        } else
            rm_note(errno, "open", name);
        return;
    }
    snprintf(stack[0].name, sizeof stack[0].name, "%s", name);
    memset(&stack[0].names, 0, sizeof stack[0].names);
    int r = read_names(stack[0].fd, &stack[0].names);
    if (r < 0)
        rm_note(-r, "read", name);
    for (;;) {
        struct rm_frame *f = &stack[top];
        unsigned char type;
        const char *entry = names_next(&f->names, &type);
        if (!entry) {
            close(f->fd);
            free(f->names.buf);
            int pfd = top == 0 ? parentfd : stack[top - 1].fd;
            if (unlinkat(pfd, f->name, AT_REMOVEDIR) < 0)
                rm_note(errno, "rmdir", f->name);
            if (top-- == 0)
                return;
            continue;
        }
        if (type != DT_DIR && type != DT_UNKNOWN) {
            if (unlinkat(f->fd, entry, 0) == 0)
                continue;
            if (errno != EISDIR) {
                rm_note(errno, "unlink", entry);
                continue;
            }
            /* it became a directory meanwhile: remove it as one */
        }
        int fd = openat(f->fd, entry, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) {
            if (errno == ENOTDIR || errno == ELOOP) {
                if (unlinkat(f->fd, entry, 0) < 0)
                    rm_note(errno, "unlink", entry);
            } else
                rm_note(errno, "open", entry);
            continue;
        }
        if (top + 1 == RM_MAX_DEPTH) {
            /* Too deep to descend: move it up to the top directory and take it from there. */
            close(fd);
            char moved[64];
            for (;;) {
                snprintf(moved, sizeof moved, "..dsec-rm-%lu", renamed++);
                if (renameat2(f->fd, entry, stack[0].fd, moved, RENAME_NOREPLACE) == 0)
                    break;
                if (errno != EEXIST) {
                    rm_note(errno, "rename", entry);
                    moved[0] = 0;
                    break;
                }
            }
            if (moved[0])
                names_add(&stack[0].names, DT_DIR, moved);
            continue;
        }
        top++;
        stack[top].fd = fd;
        snprintf(stack[top].name, sizeof stack[top].name, "%s", entry);
        memset(&stack[top].names, 0, sizeof stack[top].names);
        r = read_names(fd, &stack[top].names);
        if (r < 0)
            rm_note(-r, "read", entry);
    }
}

/* Removes `name` in parentfd, whatever it is. */
static void rm_entry(int parentfd, const char *name)
{
    struct stat st;
    if (fstatat(parentfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
        rm_note(errno, "stat", name);
        return;
    }
    if (S_ISDIR(st.st_mode))
        rm_dir(parentfd, name);
    else if (unlinkat(parentfd, name, 0) < 0)
        rm_note(errno, "unlink", name);
}

static int cmd_rm(int argc, char **argv)
{
    if (argc != 1)
        dief(EINVAL, "usage: tree rm PATH");
    char parent[PATH_MAX];
    const char *name = split(argv[0], parent, sizeof parent);
    if (!name[0] || strcmp(name, ".") == 0 || strcmp(name, "..") == 0)
        dief(EINVAL, "tree rm: %s", argv[0]);
    /* PATH itself is the platform's (its last component is not followed). */
    int pfd = open(argv[0][0] == '/' && !parent[0] ? "/" : parent[0] ? parent : ".",
                   O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (pfd < 0) {
        if (errno == ENOENT)
            return 0; /* nothing there to remove */
        dief(errno, "tree rm: open %s", parent);
    }
    struct stat st;
    if (fstatat(pfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0)
        return errno == ENOENT ? 0 : (report_error(argv[0], errno), 1);
    rm_entry(pfd, name);
    return rm_first_error ? 1 : 0;
}

/* ---- patterns, shadow, scrub ---- */

struct pattern {
    const char *rel;
    int subtree;
};

struct layers {
    int fds[MAX_LOWERS];
    int n;
};

static int parse_patterns(int argc, char **argv, int start, struct pattern *out, struct layers *lowers,
                          uint64_t *host_id)
{
    int n = 0;
    for (int i = start; i < argc; i++) {
        if (i + 1 >= argc)
            dief(EINVAL, "tree: %s needs a value", argv[i]);
        const char *v = argv[i + 1];
        if (strcmp(argv[i], "--lower") == 0) {
            if (lowers->n == MAX_LOWERS)
                dief(E2BIG, "tree: at most %d lowers", MAX_LOWERS);
            lowers->fds[lowers->n++] = open_root(v);
        } else if (host_id && strcmp(argv[i], "--host-id") == 0) {
            if (parse_u64(v, UINT32_MAX, host_id))
                dief(EINVAL, "tree: --host-id %s", v);
        } else if (strcmp(argv[i], "--path") == 0 || strcmp(argv[i], "--subtree") == 0) {
            if (n == MAX_PATTERNS)
                dief(E2BIG, "tree: at most %d patterns", MAX_PATTERNS);
            /* Relative, no empty, . or .. component (the platform parsed them; checked again here). */
            int sub = argv[i][2] == 's';
            if (v[0] == '/' || (!sub && !v[0]) || strstr(v, "//") ||
                (v[0] && v[strlen(v) - 1] == '/'))
                dief(EINVAL, "tree: pattern %s", v);
            for (const char *c = v; *c;) {
                size_t len = strcspn(c, "/");
                if ((len == 1 && c[0] == '.') || (len == 2 && c[0] == '.' && c[1] == '.'))
                    dief(EINVAL, "tree: pattern %s", v);
                c += len + (c[len] == '/');
            }
            out[n++] = (struct pattern){ v, sub };
        } else
            dief(EINVAL, "tree: unknown option %s", argv[i]);
        i++;
    }
    return n;
}

static int is_opaque(int dirfd)
{
    char v[2];
    ssize_t n = fgetxattr(dirfd, OPAQUE_XATTR, v, sizeof v);
    return n == 1 && v[0] == 'y';
}

/*
 * What the lower layers (top first, from layer `start`) show at REL, looked
 * up as overlayfs does: the topmost layer with an entry there wins; a
 * whiteout or a non-directory on the way hides everything below it, and an
 * opaque directory hides the layers under it. Returns the layer's index and
 * fills *st, or -1 when REL is hidden or absent. Symlinks are entries like
 * any other: never followed.
 */
static int lower_lookup(const struct layers *lowers, int start, const char *rel, struct stat *st)
{
    if (!rel[0]) {
        if (start >= lowers->n || fstat(lowers->fds[start], st) < 0)
            return -1;
        return start;
    }
    for (int i = start; i < lowers->n; i++) {
        int cur = dup(lowers->fds[i]);
        if (cur < 0)
            die("tree: dup", errno);
        int opaque_above = 0;
        for (const char *c = rel;;) {
            size_t len = strcspn(c, "/");
            char name[NAME_MAX + 1];
            if (len > NAME_MAX) {
                close(cur);
                return -1;
            }
            memcpy(name, c, len);
            name[len] = 0;
            int last = c[len] == 0;
            if (fstatat(cur, name, st, AT_SYMLINK_NOFOLLOW) < 0) {
                close(cur);
                if (opaque_above)
                    return -1; /* this layer hides the rest, and has nothing here */
                break;         /* nothing in this layer: look further down */
            }
            if (is_whiteout(st) || (!last && !S_ISDIR(st->st_mode))) {
                close(cur);
                return -1; /* hidden from here down */
            }
            if (last) {
                close(cur);
                return i;
            }
            int next = openat(cur, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            close(cur);
            if (next < 0)
                return -1;
            if (is_opaque(next))
                opaque_above = 1;
            cur = next;
            c += len + 1;
        }
    }
    return -1;
}

/* Opens REL in layer i (found there by lower_lookup: real directories all the way). */
static int open_in_layer(const struct layers *lowers, int i, const char *rel)
{
    return open_beneath(lowers->fds[i], rel, O_RDONLY | O_DIRECTORY);
}

/* Whether the lower layers show what the pattern names (a subtree: a directory with something in it). */
static int lower_shows(const struct layers *lowers, const struct pattern *p)
{
    struct stat st;
    for (int from = 0;;) {
        int i = lower_lookup(lowers, from, p->rel, &st);
        if (i < 0)
            return 0;
        if (!p->subtree)
            return 1;
        if (!S_ISDIR(st.st_mode))
            return 0;
        int fd = open_in_layer(lowers, i, p->rel);
        if (fd < 0)
            return 0;
        int full = nonempty_dir(fd, NULL), opaque = is_opaque(fd);
        close(fd);
        if (full)
            return 1;
        if (opaque)
            return 0;
        from = i + 1; /* empty here: the directory merges with the layers below */
    }
}

static int cmd_shadow(int argc, char **argv)
{
    static struct pattern patterns[MAX_PATTERNS];
    struct layers lowers = { .n = 0 };
    int n = parse_patterns(argc, argv, 0, patterns, &lowers, NULL);
    for (int i = 0; i < n; i++)
        if (lower_shows(&lowers, &patterns[i]))
            printf("%d\n", i);
    fflush(stdout);
    return 0;
}

/* The directory the lower layers show at REL: its mode and owner. */
static int lower_dir_stat(const struct layers *lowers, const char *rel, struct stat *st)
{
    return lower_lookup(lowers, 0, rel, st) >= 0 && S_ISDIR(st->st_mode) ? 0 : -1;
}

static void set_opaque(int dirfd, const char *what)
{
    if (fsetxattr(dirfd, OPAQUE_XATTR, "y", 1, 0) < 0)
        dief(errno, "tree scrub: mark %s opaque", what);
}

/*
 * Opens the directory REL in rootfd, creating what is missing as the lower
 * layers show it (a whiteout in the way is replaced by an opaque directory:
 * the layers below must not show through it). Returns -1 when a symlink or a
 * file stands in the way: the entry there already hides the lower layers.
 */
static int ensure_dir(int rootfd, const char *rel, const struct layers *lowers, uint32_t host_id)
{
    int cur = dup(rootfd);
    if (cur < 0)
        die("tree scrub: dup", errno);
    char prefix[PATH_MAX];
    size_t plen = 0;
    for (const char *c = rel; *c;) {
        size_t len = strcspn(c, "/");
        char name[NAME_MAX + 1];
        if (len > NAME_MAX || plen + len + 2 > sizeof prefix)
            dief(ENAMETOOLONG, "tree scrub: %s", rel);
        memcpy(name, c, len);
        name[len] = 0;
        if (plen)
            prefix[plen++] = '/';
        memcpy(prefix + plen, name, len + 1);
        plen += len;
        c += len + (c[len] == '/');

        int next = openat(cur, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        int opaque = 0;
        if (next < 0) {
            struct stat st;
            int err = errno;
            if (err == ENOTDIR && fstatat(cur, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && is_whiteout(&st)) {
                if (unlinkat(cur, name, 0) < 0)
                    dief(errno, "tree scrub: replace the whiteout %s", prefix);
                opaque = 1;
                err = ENOENT;
            }
            if (err != ENOENT) {
                close(cur);
                return -1; /* a symlink or a file: blocked */
            }
            struct stat lower;
            int have = lower_dir_stat(lowers, prefix, &lower) == 0;
            if (mkdirat(cur, name, 0700) < 0)
                dief(errno, "tree scrub: mkdir %s", prefix);
            next = openat(cur, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (next < 0)
                dief(errno, "tree scrub: open %s", prefix);
            if (fchown(next, host_id + (have ? lower.st_uid : 0), host_id + (have ? lower.st_gid : 0)) < 0 ||
                fchmod(next, have ? lower.st_mode & 07777 : 0755) < 0)
                dief(errno, "tree scrub: set up %s", prefix);
            if (opaque)
                set_opaque(next, prefix);
        }
        close(cur);
        cur = next;
    }
    return cur;
}

static int cmd_scrub(int argc, char **argv)
{
    if (argc < 1)
        dief(EINVAL, "usage: tree scrub ROOT --host-id N [--lower DIR]... (--path REL | --subtree REL)...");
    static struct pattern patterns[MAX_PATTERNS];
    struct layers lowers = { .n = 0 };
    uint64_t host_id = UINT64_MAX;
    int n = parse_patterns(argc, argv, 1, patterns, &lowers, &host_id);
    if (host_id == UINT64_MAX)
        dief(EINVAL, "tree scrub: --host-id is required");
    int rootfd = open_root(argv[0]);
    umask(0);
    char parent[PATH_MAX];
    for (int i = 0; i < n; i++) {
        const struct pattern *p = &patterns[i];
        int shadow = lower_shows(&lowers, p);
        if (p->subtree) {
            int dfd = open_beneath(rootfd, p->rel, O_RDONLY | O_DIRECTORY);
            if (dfd >= 0) {
                struct names names = { 0 };
                int r = read_names(dfd, &names);
                if (r < 0)
                    dief(-r, "tree scrub: read %s", p->rel);
                unsigned char type;
                for (const char *e; (e = names_next(&names, &type));)
                    rm_entry(dfd, e);
                free(names.buf);
            } else if (shadow)
                dfd = ensure_dir(rootfd, p->rel, &lowers, (uint32_t)host_id);
            if (dfd >= 0 && shadow)
                set_opaque(dfd, p->rel);
            if (dfd >= 0)
                close(dfd);
        } else {
            const char *base = split(p->rel, parent, sizeof parent);
            int pfd = open_beneath(rootfd, parent, O_RDONLY | O_DIRECTORY);
            if (pfd < 0 && shadow)
                pfd = ensure_dir(rootfd, parent, &lowers, (uint32_t)host_id);
            if (pfd < 0)
                continue;
            struct stat st;
            if (fstatat(pfd, base, &st, AT_SYMLINK_NOFOLLOW) == 0)
                rm_entry(pfd, base);
            if (shadow) {
                if (mknodat(pfd, base, S_IFCHR | 0, makedev(0, 0)) < 0)
                    dief(errno, "tree scrub: whiteout %s", p->rel);
                if (fchownat(pfd, base, (uid_t)host_id, (gid_t)host_id, AT_SYMLINK_NOFOLLOW) < 0)
                    dief(errno, "tree scrub: chown %s", p->rel);
            }
            close(pfd);
        }
        if (rm_first_error)
            return 1;
    }
    return 0;
}

/* ---- merge ---- */

#define MERGE_MAX_DEPTH 1024

/* Removes every whiteout and opaque mark below (and on) dirfd: a tree nothing lies under. */
static void strip_marks(int dirfd, int depth)
{
    if (depth > MERGE_MAX_DEPTH)
        dief(ELOOP, "tree merge: deeper than %d levels", MERGE_MAX_DEPTH);
    if (fremovexattr(dirfd, OPAQUE_XATTR) < 0 && errno != ENODATA)
        die("tree merge: clear an opaque mark", errno);
    struct names names = { 0 };
    int r = read_names(dirfd, &names);
    if (r < 0)
        dief(-r, "tree merge: read a directory");
    unsigned char type;
    for (const char *e; (e = names_next(&names, &type));) {
        struct stat st;
        if (fstatat(dirfd, e, &st, AT_SYMLINK_NOFOLLOW) < 0)
            continue;
        if (is_whiteout(&st)) {
            if (unlinkat(dirfd, e, 0) < 0)
                dief(errno, "tree merge: remove the whiteout %s", e);
        } else if (S_ISDIR(st.st_mode)) {
            int fd = openat(dirfd, e, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (fd < 0)
                dief(errno, "tree merge: open %s", e);
            strip_marks(fd, depth + 1);
            close(fd);
        }
    }
    free(names.buf);
}

/*
 * Moves what the lower directory adds to the upper one, as overlayfs shows
 * the pair: an upper entry hides the lower one, directories merge unless the
 * upper is opaque or the lower entry is not a directory (then the upper one
 * becomes opaque: layers further down must not show through), an opaque
 * lower directory makes the merged one opaque. Entries move by rename.
 */
static void merge_dir(int upperfd, int lowerfd, int depth)
{
    if (depth > MERGE_MAX_DEPTH)
        dief(ELOOP, "tree merge: deeper than %d levels", MERGE_MAX_DEPTH);
    struct names names = { 0 };
    int r = read_names(lowerfd, &names);
    if (r < 0)
        dief(-r, "tree merge: read a directory");
    unsigned char type;
    for (const char *e; (e = names_next(&names, &type));) {
        struct stat up, low;
        if (fstatat(upperfd, e, &up, AT_SYMLINK_NOFOLLOW) < 0) {
            if (errno != ENOENT)
                dief(errno, "tree merge: stat %s", e);
            if (renameat(lowerfd, e, upperfd, e) < 0)
                dief(errno, "tree merge: move %s", e);
            continue;
        }
        if (!S_ISDIR(up.st_mode))
            continue; /* a file, link or whiteout above hides the lower entry */
        int ufd = openat(upperfd, e, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (ufd < 0)
            dief(errno, "tree merge: open %s", e);
        if (!is_opaque(ufd)) {
            if (fstatat(lowerfd, e, &low, AT_SYMLINK_NOFOLLOW) < 0)
                dief(errno, "tree merge: stat %s", e);
            if (S_ISDIR(low.st_mode)) {
                int lfd = openat(lowerfd, e, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
                if (lfd < 0)
                    dief(errno, "tree merge: open %s", e);
                merge_dir(ufd, lfd, depth + 1);
                if (is_opaque(lfd))
                    set_opaque(ufd, e);
                close(lfd);
            } else
                set_opaque(ufd, e);
        }
        close(ufd);
    }
    free(names.buf);
}

/*
 *   tree merge (--keep-marks | --strip-marks) TOP LOWER...
 * Merges layer trees in overlayfs format, topmost first, into TOP with the
 * view overlayfs gives of their stack; the lower trees are consumed (their
 * entries move, what is left is removed). --strip-marks: nothing lies below
 * the result (a base), so its whiteouts and opaque marks go.
 */
static int cmd_merge(int argc, char **argv)
{
    if (argc < 2 || (strcmp(argv[0], "--keep-marks") && strcmp(argv[0], "--strip-marks")))
        dief(EINVAL, "usage: tree merge (--keep-marks | --strip-marks) TOP LOWER...");
    int keep = strcmp(argv[0], "--keep-marks") == 0;
    int top = open_root(argv[1]);
    for (int i = 2; i < argc; i++) {
        if (is_opaque(top))
            break; /* the result already hides everything further down */
        int lower = open_root(argv[i]);
        merge_dir(top, lower, 0);
        if (is_opaque(lower))
            set_opaque(top, "/");
        close(lower);
    }
    for (int i = 2; i < argc; i++) {
        char parent[PATH_MAX];
        const char *name = split(argv[i], parent, sizeof parent);
        int pfd = open(parent[0] ? parent : "/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (pfd < 0)
            dief(errno, "tree merge: open %s", parent);
        struct names left = { 0 };
        int lfd = openat(pfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (lfd >= 0) {
            /* the layer's own root stays (it may be a mount point): only its contents go */
            if (read_names(lfd, &left) == 0) {
                unsigned char type;
                for (const char *e; (e = names_next(&left, &type));)
                    rm_entry(lfd, e);
            }
            free(left.buf);
            close(lfd);
        }
        close(pfd);
    }
    if (!keep)
        strip_marks(top, 0);
    return rm_first_error ? 1 : 0;
}

/* ---- chmod-node (run in a sandbox's own root: confine --ns) ---- */

static int cmd_chmod_node(int argc, char **argv)
{
    uint64_t mode, skip_dev = UINT64_MAX, skip_ino = UINT64_MAX;
    if (argc != 2 && !(argc == 4 && strcmp(argv[2], "--skip") == 0))
        dief(EINVAL, "usage: tree chmod-node PATH MODE [--skip DEV:INO]");
    char *end;
    errno = 0;
    mode = strtoull(argv[1], &end, 8); /* octal, as modes are written */
    if (argv[1][0] < '0' || argv[1][0] > '7' || *end || errno || mode > 07777)
        dief(EINVAL, "tree chmod-node: mode %s", argv[1]);
    if (argc == 4) {
        char dev[32];
        const char *colon = strchr(argv[3], ':');
        if (!colon || (size_t)(colon - argv[3]) >= sizeof dev)
            dief(EINVAL, "tree chmod-node: --skip %s", argv[3]);
        memcpy(dev, argv[3], (size_t)(colon - argv[3]));
        dev[colon - argv[3]] = 0;
        if (parse_u64(dev, UINT64_MAX, &skip_dev) || parse_u64(colon + 1, UINT64_MAX, &skip_ino))
            dief(EINVAL, "tree chmod-node: --skip %s", argv[3]);
    }
    const char *rel = argv[0];
    while (*rel == '/')
        rel++;
    char parent[PATH_MAX];
    const char *base = split(rel, parent, sizeof parent);
    int rootfd = open_root("/");
    /* A sandbox's /dev is a mount of its own: crossing mounts is fine here, symlinks are not. */
    int pfd = open_resolved(rootfd, parent, O_RDONLY | O_DIRECTORY, 0);
    struct stat st;
    if (pfd < 0 || fstatat(pfd, base, &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISCHR(st.st_mode)) {
        puts("absent");
        return 0;
    }
    if ((uint64_t)st.st_dev == skip_dev && (uint64_t)st.st_ino == skip_ino)
        puts("host");
    else if ((uint64_t)(st.st_mode & 07777) == mode)
        puts("same");
    else if (syscall(SYS_fchmodat2, pfd, base, (mode_t)mode, AT_SYMLINK_NOFOLLOW) < 0)
        dief(errno, "tree chmod-node: %s", argv[0]);
    else
        puts("changed");
    fflush(stdout);
    return 0;
}

int cmd_tree(int argc, char **argv)
{
    static const struct {
        const char *name;
        int (*run)(int, char **);
    } ops[] = {
        { "scan", cmd_scan }, { "shadow", cmd_shadow }, { "scrub", cmd_scrub },
        { "rm", cmd_rm },     { "merge", cmd_merge }, { "chmod-node", cmd_chmod_node },
    };
    if (argc >= 1)
        for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
            if (strcmp(argv[0], ops[i].name) == 0)
                return ops[i].run(argc - 1, argv + 1);
    fprintf(stderr, "usage: dsec-helper tree scan|shadow|scrub|rm|merge|chmod-node ...\n");
    return 2;
}
