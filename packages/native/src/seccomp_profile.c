/*
 * Seccomp profiles in the platform's line format:
 *   default allow|kill|errno N
 *   allow NAME | errno N NAME | kill NAME, each optionally followed by
 *   one argument condition `argI&MASK==VALUE` (the rule applies only when
 *   (arg I & MASK) == VALUE; e.g. `allow clone arg0&0x7e020000==0`).
 * `#` starts a comment; syscall names this libseccomp/arch does not know are
 * skipped, so one profile serves kernels and architectures of different ages.
 */
#include "seccomp_profile.h"

#include <errno.h>
#include <seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util.h"

#define DELIM " \t\r\n"

/* Parses "allow", "kill" or "errno N" (word is the first token; N is read from save). */
static int parse_action(char **save, const char *word, uint32_t *action)
{
    if (strcmp(word, "allow") == 0) {
        *action = SCMP_ACT_ALLOW;
        return 0;
    }
    if (strcmp(word, "kill") == 0) {
        *action = SCMP_ACT_KILL_PROCESS;
        return 0;
    }
    if (strcmp(word, "errno") == 0) {
        const char *n = strtok_r(NULL, DELIM, save);
        uint64_t v;
        if (!n || parse_u64(n, 4095, &v))
            return -1;
        *action = SCMP_ACT_ERRNO((uint16_t)v);
        return 0;
    }
    return -1;
}

/* Adds one rule; returns 0 or -1 with the reason in err. */
static int add_rule(scmp_filter_ctx ctx, uint32_t action, const char *name, const char *cond, int lineno,
                    char *err, size_t errlen)
{
    int nr = seccomp_syscall_resolve_name(name);
    if (nr == __NR_SCMP_ERROR)
        return 0; /* unknown here: skipped on purpose */
    int r;
    if (cond) {
        unsigned idx;
        unsigned long long mask, value;
        int used = 0;
        if (sscanf(cond, "arg%u&%lli==%lli%n", &idx, &mask, &value, &used) != 3 || cond[used] || idx > 5) {
            snprintf(err, errlen, "seccomp profile line %d: bad argument condition %s", lineno, cond);
            return -1;
        }
        r = seccomp_rule_add(ctx, action, nr, 1,
                             SCMP_CMP(idx, SCMP_CMP_MASKED_EQ, (scmp_datum_t)mask, (scmp_datum_t)value));
    } else {
        r = seccomp_rule_add(ctx, action, nr, 0);
    }
    /* -EACCES: the rule repeats the default action, which is harmless. */
    if (r < 0 && r != -EACCES) {
        snprintf(err, errlen, "seccomp profile line %d: rule for %s: %s", lineno, name, strerror(-r));
        return -1;
    }
    return 0;
}

/* Builds the filter context of a profile text; NULL with the reason in err. */
static scmp_filter_ctx build(const char *text, char *err, size_t errlen)
{
    char *copy = strdup(text);
    if (!copy) {
        snprintf(err, errlen, "seccomp profile: out of memory");
        return NULL;
    }
    scmp_filter_ctx ctx = NULL;
    int lineno = 0, failed = 0;
    for (char *line = copy, *next; line && !failed; line = next) {
        lineno++;
        next = strchr(line, '\n');
        if (next)
            *next++ = 0;
        char *hash = strchr(line, '#'), *save = NULL;
        if (hash)
            *hash = 0;
        char *word = strtok_r(line, DELIM, &save);
        if (!word)
            continue;
        uint32_t action;
        if (!ctx) {
            if (strcmp(word, "default") != 0 || parse_action(&save, strtok_r(NULL, DELIM, &save) ?: "", &action)) {
                snprintf(err, errlen, "seccomp profile line %d: first rule must be `default allow|kill|errno N`",
                         lineno);
                failed = 1;
            } else if (!(ctx = seccomp_init(action))) {
                snprintf(err, errlen, "seccomp_init failed");
                failed = 1;
            }
            continue;
        }
        const char *name = NULL;
        if (parse_action(&save, word, &action)) {
            snprintf(err, errlen, "seccomp profile line %d: unknown action %s", lineno, word);
            failed = 1;
        } else if (!(name = strtok_r(NULL, DELIM, &save))) {
            snprintf(err, errlen, "seccomp profile line %d: missing syscall name", lineno);
            failed = 1;
        } else {
            failed = add_rule(ctx, action, name, strtok_r(NULL, DELIM, &save), lineno, err, errlen) < 0;
        }
    }
    free(copy);
    if (!ctx && !failed)
        snprintf(err, errlen, "empty seccomp profile");
    if (failed || !ctx) {
        if (ctx)
            seccomp_release(ctx);
        return NULL;
    }
    /* A binary tree instead of a linear scan of ~330 rules: every syscall of
     * every command pays for the filter, so its depth matters. */
    int r = seccomp_attr_set(ctx, SCMP_FLTATR_CTL_OPTIMIZE, 2);
    if (r < 0) {
        snprintf(err, errlen, "seccomp_attr_set(CTL_OPTIMIZE): %s", strerror(-r));
        seccomp_release(ctx);
        return NULL;
    }
    return ctx;
}

int seccomp_profile_compile(const char *text, struct sock_fprog *out, char *err, size_t errlen)
{
    scmp_filter_ctx ctx = build(text, err, errlen);
    if (!ctx)
        return -1;
    /* libseccomp 2.5 exports only to a file descriptor: go through a memfd. */
    int fd = memfd_create("dsec-seccomp", MFD_CLOEXEC);
    int r = fd < 0 ? -errno : seccomp_export_bpf(ctx, fd);
    seccomp_release(ctx);
    struct stat sb;
    if (r == 0 && fstat(fd, &sb) < 0)
        r = -errno;
    size_t size = r == 0 ? (size_t)sb.st_size : 0;
    void *prog = NULL;
    if (r == 0 && (size == 0 || size % sizeof(struct sock_filter) || size / sizeof(struct sock_filter) > BPF_MAXINSNS))
        r = -E2BIG;
    if (r == 0 && !(prog = malloc(size)))
        r = -ENOMEM;
    if (r == 0 && pread(fd, prog, size, 0) != (ssize_t)size)
        r = -EIO;
    if (fd >= 0)
        close(fd);
    if (r < 0) {
        free(prog);
        snprintf(err, errlen, "export seccomp filter: %s", strerror(-r));
        return -1;
    }
    out->len = (unsigned short)(size / sizeof(struct sock_filter));
    out->filter = prog;
    return 0;
}

/*
 * `dsec-helper seccomp-bpf`: compiles the profile text on stdin and writes the
 * BPF program (struct sock_filter[]) to stdout, for runtimes that load a
 * precompiled filter (crun's run.oci.seccomp_bpf_data) instead of compiling
 * the OCI profile on every container start.
 */
int cmd_seccomp_bpf(int argc, char **argv)
{
    (void)argv;
    if (argc != 0)
        dief(EINVAL, "usage: seccomp-bpf < PROFILE");
    size_t cap = 1 << 16, len = 0;
    char *text = malloc(cap);
    if (!text)
        die("profile", ENOMEM);
    for (;;) {
        if (len + 1 == cap) {
            char *grown = realloc(text, cap *= 2);
            if (!grown)
                die("profile", ENOMEM);
            text = grown;
        }
        ssize_t n = read(0, text + len, cap - 1 - len);
        if (n < 0)
            die("read profile", errno);
        if (n == 0)
            break;
        len += (size_t)n;
    }
    text[len] = 0;
    struct sock_fprog prog;
    char err[256];
    if (seccomp_profile_compile(text, &prog, err, sizeof err) < 0)
        dief(EINVAL, "%s", err);
    int r = write_all(1, prog.filter, prog.len * sizeof(struct sock_filter));
    if (r < 0)
        die("write", -r);
    return 0;
}
