#ifndef DSEC_SECCOMP_PROFILE_H
#define DSEC_SECCOMP_PROFILE_H

#include <linux/filter.h>
#include <stddef.h>

/*
 * Compiles a profile text (the line format in seccomp_profile.c) into the
 * classic BPF program libseccomp would load: out->filter is malloc'ed.
 * Returns 0, or -1 with a one-line reason in err. Loading it is the
 * caller's business (seccomp(SECCOMP_SET_MODE_FILTER, 0, out)), so one
 * compiled program can serve many processes.
 */
int seccomp_profile_compile(const char *text, struct sock_fprog *out, char *err, size_t errlen);

#endif
