/**
 * The sandbox seccomp profile: an allowlist in the spirit of Docker's default
 * (SECURITY.md A5), written once and emitted in two forms — OCI JSON for the
 * runtime (which filters the sandbox's init) and the line format the chronus
 * daemon loads before forking commands into the sandbox.
 *
 * Not allowed, so EPERM: mount and the new mount API, pivot_root, unshare,
 * setns, bpf, perf_event_open, userfaultfd, keyctl/add_key/request_key,
 * kexec_*, *_module, open_by_handle_at, io_uring_*, acct, swapon/off,
 * reboot, settimeofday/clock_settime, quotactl, syslog, iopl/ioperm, …
 * `clone3` answers ENOSYS so libc falls back to `clone`.
 */
const ALLOWED = `
accept accept4 access adjtimex alarm arch_prctl bind brk capget capset chdir chmod chown chown32
chroot clock_adjtime clock_getres clock_gettime clock_nanosleep close close_range connect
copy_file_range creat dup dup2 dup3 epoll_create epoll_create1 epoll_ctl epoll_pwait epoll_pwait2
epoll_wait eventfd eventfd2 execve execveat exit exit_group faccessat faccessat2 fadvise64
fallocate fanotify_mark fchdir fchmod fchmodat fchmodat2 fchown fchownat fcntl fdatasync fgetxattr
flistxattr flock fork fremovexattr fsetxattr fstat fstatfs fsync ftruncate futex futex_waitv
futimesat get_robust_list getcpu getcwd getdents getdents64 getegid geteuid getgid getgroups
getitimer getpeername getpgid getpgrp getpid getppid getpriority getrandom getresgid getresuid
getrlimit getrusage getsid getsockname getsockopt gettid gettimeofday getuid getxattr
inotify_add_watch inotify_init inotify_init1 inotify_rm_watch io_cancel io_destroy io_getevents
io_pgetevents io_setup io_submit ioctl ioprio_get ioprio_set ipc kcmp kill landlock_add_rule
landlock_create_ruleset landlock_restrict_self lchown lgetxattr link linkat listen listxattr
llistxattr lremovexattr lseek lsetxattr lstat madvise membarrier memfd_create mincore mkdir mkdirat
mknod mknodat mlock mlock2 mlockall mmap mprotect mq_getsetattr mq_notify mq_open mq_timedreceive
mq_timedsend mq_unlink mremap msgctl msgget msgrcv msgsnd msync munlock munlockall munmap
name_to_handle_at nanosleep newfstatat open openat openat2 pause personality pidfd_getfd
pidfd_open pidfd_send_signal pipe pipe2 pkey_alloc pkey_free pkey_mprotect poll ppoll prctl pread64
preadv preadv2 prlimit64 process_mrelease pselect6 ptrace pwrite64 pwritev pwritev2 read readahead
readlink readlinkat readv recvfrom recvmmsg recvmsg remap_file_pages removexattr rename renameat
renameat2 restart_syscall rmdir rseq rt_sigaction rt_sigpending rt_sigprocmask rt_sigqueueinfo
rt_sigreturn rt_sigsuspend rt_sigtimedwait rt_tgsigqueueinfo sched_get_priority_max
sched_get_priority_min sched_getaffinity sched_getattr sched_getparam sched_getscheduler
sched_rr_get_interval sched_setaffinity sched_setattr sched_setparam sched_setscheduler sched_yield
seccomp select semctl semget semop semtimedop sendfile sendmmsg sendmsg sendto set_robust_list
set_tid_address setfsgid setfsuid setgid setgroups setitimer setpgid setpriority setregid setresgid
setresuid setreuid setrlimit setsid setsockopt setuid setxattr shmat shmctl shmdt shmget shutdown
sigaltstack signalfd signalfd4 socket socketpair splice stat statfs statx symlink symlinkat sync
sync_file_range syncfs sysinfo tee tgkill time timer_create timer_delete timer_getoverrun
timer_gettime timer_settime timerfd_create timerfd_gettime timerfd_settime times tkill truncate
umask uname unlink unlinkat utime utimensat utimes vfork vmsplice wait4 waitid write writev
`
  .split(/\s+/)
  .filter(Boolean);

/**
 * `clone` is allowed only without namespace flags (Docker's rule): a process
 * in the sandbox cannot make a new user namespace (where it would hold every
 * capability), nor mount, pid, net, ipc, uts or cgroup namespaces.
 * CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET.
 */
const CLONE_NAMESPACE_FLAGS = 0x7e020000;

/** Syscalls that must fail with ENOSYS rather than EPERM so callers fall back. */
const ENOSYS_CALLS = ['clone3'];
const EPERM = 1;
const ENOSYS = 38;

export function seccompOci(): Record<string, unknown> {
  return {
    defaultAction: 'SCMP_ACT_ERRNO',
    defaultErrnoRet: EPERM,
    architectures: ['SCMP_ARCH_X86_64', 'SCMP_ARCH_X86', 'SCMP_ARCH_X32'],
    syscalls: [
      { names: ALLOWED, action: 'SCMP_ACT_ALLOW' },
      {
        names: ['clone'],
        action: 'SCMP_ACT_ALLOW',
        args: [{ index: 0, value: CLONE_NAMESPACE_FLAGS, valueTwo: 0, op: 'SCMP_CMP_MASKED_EQ' }],
      },
      { names: ENOSYS_CALLS, action: 'SCMP_ACT_ERRNO', errnoRet: ENOSYS },
    ],
  };
}

export function seccompLines(): string {
  return [
    `default errno ${EPERM}`,
    ...ALLOWED.map((name) => `allow ${name}`),
    `allow clone arg0&0x${CLONE_NAMESPACE_FLAGS.toString(16)}==0`,
    ...ENOSYS_CALLS.map((name) => `errno ${ENOSYS} ${name}`),
    '',
  ].join('\n');
}
