/*
 * dsec-xattr: the `user.e2b.*` extended attributes of files (E2B's file
 * metadata), for the E2B layer to run inside a sandbox, whose own tools may
 * have none (busybox has no setfattr). Static, no dependencies; it runs as
 * any other command in the sandbox, so every path resolves there.
 *
 *   dsec-xattr get         stdin: paths, each ended by a newline (at most 10000, 16 MiB in all)
 *                          stdout: a line per path: "-" (no such file, or not readable), or
 *                          "+" followed by " KEY=VALUE" per attribute, both in hex, the
 *                          `user.e2b.` prefix left out
 *   dsec-xattr set PATH    stdin: lines "KEY=VALUE" (hex), the file's whole new metadata:
 *                          attributes under `user.e2b.` not named are removed
 *
 * Exit status: 0 done, 2 usage or malformed input, 3 the file cannot be read or
 * changed (errno on stderr), 4 the file system refuses user attributes.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/xattr.h>
#include <unistd.h>

#define PREFIX "user.e2b."
#define PREFIX_LEN (sizeof PREFIX - 1)
#define MAX_INPUT (16u << 20)
#define MAX_PATHS 10000
#define MAX_NAMES (64u << 10)
#define MAX_VALUE 4096

static char *read_all(size_t *len) {
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf) return NULL;
    for (;;) {
        if (n == cap) {
            if (cap >= MAX_INPUT) { free(buf); errno = EFBIG; return NULL; }
            cap *= 2;
            char *b = realloc(buf, cap + 1);
            if (!b) { free(buf); return NULL; }
            buf = b;
        }
        ssize_t r = read(0, buf + n, cap - n);
        if (r < 0) { if (errno == EINTR) continue; free(buf); return NULL; }
        if (r == 0) break;
        n += (size_t)r;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

static void put_hex(const unsigned char *p, size_t n) {
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) { putchar(d[p[i] >> 4]); putchar(d[p[i] & 15]); }
}

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Decodes n hex digits at s into out (n/2 bytes); -1 if malformed. */
static int unhex(const char *s, size_t n, char *out) {
    if (n % 2) return -1;
    for (size_t i = 0; i < n; i += 2) {
        int a = hexval(s[i]), b = hexval(s[i + 1]);
        if (a < 0 || b < 0) return -1;
        out[i / 2] = (char)(a * 16 + b);
    }
    return 0;
}

static char names[MAX_NAMES];

static int get_one(const char *path) {
    ssize_t n = listxattr(path, names, sizeof names);
    if (n < 0) {
        /* No attributes support: no metadata, but the file is there. */
        if (errno == ENOTSUP) { puts("+"); return 0; }
        puts("-");
        return 0;
    }
    putchar('+');
    unsigned char value[MAX_VALUE];
    for (ssize_t off = 0; off < n; off += (ssize_t)strlen(names + off) + 1) {
        const char *name = names + off;
        if (strncmp(name, PREFIX, PREFIX_LEN) != 0) continue;
        ssize_t v = getxattr(path, name, value, sizeof value);
        if (v < 0) continue; /* gone meanwhile, or larger than metadata may be */
        putchar(' ');
        put_hex((const unsigned char *)name + PREFIX_LEN, strlen(name) - PREFIX_LEN);
        putchar('=');
        put_hex(value, (size_t)v);
    }
    putchar('\n');
    return 0;
}

static int cmd_get(void) {
    size_t len;
    char *in = read_all(&len);
    if (!in) { perror("dsec-xattr: stdin"); return 2; }
    int count = 0;
    for (size_t off = 0; off < len; count++) {
        if (count >= MAX_PATHS) { fputs("dsec-xattr: too many paths\n", stderr); return 2; }
        char *end = memchr(in + off, '\n', len - off);
        if (!end) { fputs("dsec-xattr: a path is not newline-terminated\n", stderr); return 2; }
        *end = 0;
        get_one(in + off);
        off = (size_t)(end - in) + 1;
    }
    return fflush(stdout) == 0 ? 0 : 3;
}

static int cmd_set(const char *path) {
    size_t len;
    char *in = read_all(&len);
    if (!in) { perror("dsec-xattr: stdin"); return 2; }
    /* Parse everything first: malformed input changes nothing. */
    char *keys[256];
    char *vals[256];
    size_t vlen[256];
    int count = 0;
    for (char *line = in; *line;) {
        char *nl = strchr(line, '\n');
        size_t n = nl ? (size_t)(nl - line) : strlen(line);
        char *eq = memchr(line, '=', n);
        if (n > 0) {
            if (!eq || count >= 256) { fputs("dsec-xattr: malformed input\n", stderr); return 2; }
            size_t kn = (size_t)(eq - line), vn = n - kn - 1;
            if (kn == 0 || kn / 2 > 246 || vn / 2 > MAX_VALUE) {
                fputs("dsec-xattr: key or value too long\n", stderr);
                return 2;
            }
            char *k = calloc(1, PREFIX_LEN + kn / 2 + 1), *v = malloc(vn / 2 + 1);
            if (!k || !v) return 3;
            memcpy(k, PREFIX, PREFIX_LEN);
            if (unhex(line, kn, k + PREFIX_LEN) < 0 || unhex(eq + 1, vn, v) < 0 ||
                memchr(k, 0, PREFIX_LEN + kn / 2) != NULL) {
                fputs("dsec-xattr: malformed input\n", stderr);
                return 2;
            }
            keys[count] = k;
            vals[count] = v;
            vlen[count] = vn / 2;
            count++;
        }
        if (!nl) break;
        line = nl + 1;
    }
    ssize_t n = listxattr(path, names, sizeof names);
    if (n < 0) {
        if (errno == ENOTSUP) {
            if (count == 0) return 0;
            fputs("dsec-xattr: the file system has no user attributes\n", stderr);
            return 4;
        }
        fprintf(stderr, "dsec-xattr: %s: %s\n", path, strerror(errno));
        return 3;
    }
    for (ssize_t off = 0; off < n; off += (ssize_t)strlen(names + off) + 1) {
        const char *name = names + off;
        if (strncmp(name, PREFIX, PREFIX_LEN) != 0) continue;
        int keep = 0;
        for (int i = 0; i < count && !keep; i++) keep = strcmp(keys[i], name) == 0;
        if (!keep && removexattr(path, name) < 0 && errno != ENODATA) {
            fprintf(stderr, "dsec-xattr: %s: %s\n", path, strerror(errno));
            return 3;
        }
    }
    for (int i = 0; i < count; i++) {
        if (setxattr(path, keys[i], vals[i], vlen[i], 0) < 0) {
            int e = errno;
            fprintf(stderr, "dsec-xattr: %s: %s\n", path, strerror(e));
            return e == ENOTSUP ? 4 : 3;
        }
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "get") == 0) return cmd_get();
    if (argc == 3 && strcmp(argv[1], "set") == 0) return cmd_set(argv[2]);
    fputs("usage: dsec-xattr get < paths | dsec-xattr set PATH < KEY=VALUE lines\n", stderr);
    return 2;
}
