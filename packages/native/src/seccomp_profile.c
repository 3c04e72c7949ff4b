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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static void add_rule(scmp_filter_ctx ctx, uint32_t action, const char *name, const char *cond,
                     const char *path, int lineno)
{
    int nr = seccomp_syscall_resolve_name(name);
    if (nr == __NR_SCMP_ERROR)
        return; /* unknown here: skipped on purpose */
    int r;
    if (cond) {
        unsigned idx;
        unsigned long long mask, value;
        int used = 0;
        if (sscanf(cond, "arg%u&%lli==%lli%n", &idx, &mask, &value, &used) != 3 || cond[used] || idx > 5)
            dief(EINVAL, "%s:%d: bad argument condition %s", path, lineno, cond);
        r = seccomp_rule_add(ctx, action, nr, 1,
                             SCMP_CMP(idx, SCMP_CMP_MASKED_EQ, (scmp_datum_t)mask, (scmp_datum_t)value));
    } else {
        r = seccomp_rule_add(ctx, action, nr, 0);
    }
    /* -EACCES: the rule repeats the default action, which is harmless. */
    if (r < 0 && r != -EACCES)
        dief(-r, "%s:%d: seccomp rule for %s", path, lineno, name);
}

scmp_filter_ctx seccomp_profile_build(const char *path, int no_new_privs)
{
    FILE *f = fopen(path, "re");
    if (!f)
        dief(errno, "open seccomp profile %s", path);
    scmp_filter_ctx ctx = NULL;
    char *line = NULL;
    size_t cap = 0;
    int lineno = 0;
    while (getline(&line, &cap, f) >= 0) {
        lineno++;
        char *hash = strchr(line, '#'), *save = NULL;
        if (hash)
            *hash = 0;
        char *word = strtok_r(line, DELIM, &save);
        if (!word)
            continue;
        uint32_t action;
        if (!ctx) {
            if (strcmp(word, "default") != 0 || parse_action(&save, strtok_r(NULL, DELIM, &save) ?: "", &action))
                dief(EINVAL, "%s:%d: first rule must be `default allow|kill|errno N`", path, lineno);
            if (!(ctx = seccomp_init(action)))
                dief(ENOMEM, "seccomp_init");
            continue;
        }
        if (parse_action(&save, word, &action))
            dief(EINVAL, "%s:%d: unknown action %s", path, lineno, word);
        const char *name = strtok_r(NULL, DELIM, &save);
        if (!name)
            dief(EINVAL, "%s:%d: missing syscall name", path, lineno);
        add_rule(ctx, action, name, strtok_r(NULL, DELIM, &save), path, lineno);
    }
    free(line);
    fclose(f);
    if (!ctx)
        dief(EINVAL, "%s: empty seccomp profile", path);
    /* libseccomp sets no_new_privs on load by default; only --no-new-privs may. */
    int r = seccomp_attr_set(ctx, SCMP_FLTATR_CTL_NNP, no_new_privs ? 1 : 0);
    if (r < 0)
        dief(-r, "seccomp_attr_set(CTL_NNP)");
    /* A binary tree instead of a linear scan of ~330 rules: every syscall of
     * every command pays for the filter, so its depth matters. */
    r = seccomp_attr_set(ctx, SCMP_FLTATR_CTL_OPTIMIZE, 2);
    if (r < 0)
        dief(-r, "seccomp_attr_set(CTL_OPTIMIZE)");
    return ctx;
}
