/*
 * dsec-init: PID 1 of every sandbox container.
 *
 * It only reaps zombies (orphans re-parent to PID 1) and exits 0 on
 * SIGTERM/SIGINT, which is how the edge stops a sandbox. Every other signal
 * stays blocked, so nothing inside the sandbox can make it exit otherwise.
 * Static and libc-light on purpose: it is bind-mounted read-only from the
 * host and must not depend on anything inside the sandbox image.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void detach_stdio(void)
{
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    for (int fd = 0; fd <= 2; fd++) {
        if (null >= 0)
            dup2(null, fd);
        else
            close(fd);
    }
    if (null > 2)
        close(null);
}

static void reap_all(void)
{
    while (waitpid(-1, NULL, WNOHANG) > 0)
        ;
}

int main(void)
{
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, NULL);

    static const char ready[] = "ready\n";
    (void)!write(1, ready, sizeof ready - 1);
    detach_stdio();

    sigset_t wanted;
    sigemptyset(&wanted);
    sigaddset(&wanted, SIGCHLD);
    sigaddset(&wanted, SIGTERM);
    sigaddset(&wanted, SIGINT);
    for (;;) {
        int sig = sigwaitinfo(&wanted, NULL);
        if (sig == SIGTERM || sig == SIGINT)
            _exit(0);
        /* SIGCHLD coalesces: one delivery may stand for many dead children. */
        reap_all();
    }
}
