#include "util.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void report_error(const char *what, int err)
{
    fprintf(stderr, "dsec-helper: %s: %s (errno %d)\n", what, strerror(err), err);
}

_Noreturn void die(const char *what, int err)
{
    report_error(what, err);
    exit(1);
}

_Noreturn void dief(int err, const char *fmt, ...)
{
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    die(what, err ? err : EINVAL);
}

int write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int parse_u64(const char *s, uint64_t max, uint64_t *out)
{
    if (*s < '0' || *s > '9')
        return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v > max)
        return -1;
    *out = v;
    return 0;
}

static char *argv_start;
static size_t argv_len;

void save_argv(int argc, char **argv)
{
    if (argc < 1)
        return;
    argv_start = argv[0];
    argv_len = (size_t)(argv[argc - 1] + strlen(argv[argc - 1]) - argv[0]);
}

void set_process_title(const char *title)
{
    if (!argv_start)
        return;
    memset(argv_start, 0, argv_len);
    strncpy(argv_start, title, argv_len);
}
