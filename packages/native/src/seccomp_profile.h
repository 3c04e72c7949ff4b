#ifndef DSEC_SECCOMP_PROFILE_H
#define DSEC_SECCOMP_PROFILE_H

#include <seccomp.h>

/* Reads a profile file and builds (does not load) its filter; dies on errors. */
scmp_filter_ctx seccomp_profile_build(const char *path, int no_new_privs);

#endif
