/* Small helpers shared by the dsec-helper subcommands. */
#ifndef DSEC_UTIL_H
#define DSEC_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Prints `dsec-helper: <what>: <strerror(err)> (errno err)` to stderr. */
void report_error(const char *what, int err);

/* report_error() then exit(1). */
_Noreturn void die(const char *what, int err);

/* printf-style `what`, then die(); `err` is an errno value (0 → EINVAL). */
_Noreturn void dief(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Writes all of buf, retrying on EINTR/short writes. Returns 0 or -errno. */
int write_all(int fd, const void *buf, size_t len);

/* Parses a decimal unsigned integer that must fit in max; returns 0 or -1. */
int parse_u64(const char *s, uint64_t max, uint64_t *out);

/* Remembers main()'s argv so that set_process_title() can overwrite it. */
void save_argv(int argc, char **argv);

/* Replaces what /proc/PID/cmdline shows (reapers are visible inside the sandbox). */
void set_process_title(const char *title);

/* Little-endian accessors for the wire protocol. */
static inline uint16_t get_u16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t get_u32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline void put_u32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}
static inline void put_u64(unsigned char *p, uint64_t v)
{
    put_u32(p, (uint32_t)v);
    put_u32(p + 4, (uint32_t)(v >> 32));
}

#endif
