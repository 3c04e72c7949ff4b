/*
 * The chronus event loop: one thread, one epoll set, non-blocking fds.
 *
 * Objects: connections (client sockets), commands (one per SPAWN, each
 * with a reaper process and up to four fds: control socket, stdin, stdout,
 * stderr) and idle reapers (a reaper whose command ended cleanly, kept for
 * REAPER_IDLE_MS to run the next one instead of forking another: reaper.c).
 * Command output is read straight into the owning connection's
 * outbound buffer; once that buffer holds OUT_HIGH bytes the command's
 * output fds are paused, so a slow client back-pressures the command
 * instead of growing our memory.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "chronus.h"
#include "util.h"

#define READ_CHUNK 65536u
#define OUT_HIGH (1u << 20)    /* pause command output above this many queued bytes */
#define STDIN_HIGH (1u << 20)  /* stop reading a client whose command's stdin backs up */
#define PTY_GRACE_MS 50        /* pty output can trail the exit (tty flush is asynchronous) */
#define STDOUT_PIPE_SIZE (256u << 10)
/* Idle reapers: at most this many, each kept this long. Each holds a pid of the sandbox's
   pids limit and its few private pages (charged to the sandbox) while it waits. */
#define REAPER_POOL_MAX 8
#define REAPER_IDLE_MS 5000

enum wkind { W_LISTEN, W_INIT, W_CONN, W_CTL, W_STDIN, W_STDOUT, W_STDERR, W_IDLE };

struct watch {
    enum wkind kind;
    int fd; /* -1 once closed */
    uint32_t events; /* 0: not in the epoll set (HUP/ERR would still fire otherwise) */
    void *owner;
};

struct buf {
    unsigned char *data;
    size_t off, len, cap;
};

struct conn {
    struct watch w;
    struct buf in, out;
    int dirty; /* queued output not yet written this round */
    struct conn *next_dirty;
    struct conn *next_garbage;
    int ncmds_paused_stdin;
    int dead;
};

struct cmd {
    struct cmd *prev, *next; /* all commands */
    struct conn *conn;       /* NULL once the client is gone */
    uint32_t stream, flags;
    struct watch ctl, in, out, err;
    struct buf stdin_pending;
    int stdin_eof;   /* client sent STDIN_EOF */
    int reported;    /* STARTED or SPAWN_ERROR forwarded */
    int finished;    /* reaper reported or vanished */
    int paused;      /* output reads paused for back-pressure */
    int stdin_full;  /* counted in conn->ncmds_paused_stdin */
    long drain_deadline_ms; /* pty: when to stop waiting for trailing output */
    long drain_left;        /* bytes still read after the exit, -1 before it */
    struct reclaim_stats reclaimed; /* by the daemon's fork of the reaper; added to STARTED's */
    int reaper_pidfd;               /* -1 if pidfd_open failed: the reaper is then not kept */
    unsigned char exit_msg[EXIT_PAYLOAD];
};

/* A reaper waiting for its next command (its EXIT offered it); W_IDLE fires if it dies. */
struct idle_reaper {
    struct watch ctl;
    int pidfd;
    long since_ms;
    struct idle_reaper *newer, *older;
};

static int epfd;
static const struct chronus_state *state;
static struct cmd *cmds;
static struct conn *dirty_conns;
static struct cmd *garbage_cmds;   /* freed at the end of each loop round */
static struct conn *garbage_conns; /* (pending epoll events may still point at them) */
static struct idle_reaper *idle_newest, *idle_oldest, *garbage_idle;
static int idle_count;

static long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- buffers ---- */

/* Makes room for `need` more bytes at the tail; returns 0 or -1 (no memory). */
static int buf_reserve(struct buf *b, size_t need)
{
    if (b->off + b->len + need <= b->cap)
        return 0;
    if (b->off > 0) { /* compact first: cheaper than growing */
        memmove(b->data, b->data + b->off, b->len);
        b->off = 0;
        if (b->len + need <= b->cap)
            return 0;
    }
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + need)
        cap *= 2;
    unsigned char *p = realloc(b->data, cap);
    if (!p)
        return -1;
    b->data = p;
    b->cap = cap;
    return 0;
}

static void buf_consume(struct buf *b, size_t n)
{
    b->off += n;
    b->len -= n;
    if (b->len == 0)
        b->off = 0;
}

static void buf_free(struct buf *b)
{
    free(b->data);
    *b = (struct buf){ 0 };
}

/* ---- epoll watches ---- */

/* Events 0 removes the fd from the epoll set: a paused fd must not report HUP. */
static int watch_set(struct watch *w, uint32_t events)
{
    if (w->fd < 0 || w->events == events)
        return 0;
    struct epoll_event ev = { .events = events, .data.ptr = w };
    int op = !events ? EPOLL_CTL_DEL : !w->events ? EPOLL_CTL_ADD : EPOLL_CTL_MOD;
    if (epoll_ctl(epfd, op, w->fd, &ev) < 0)
        return -1;
    w->events = events;
    return 0;
}

static int watch_add(struct watch *w, enum wkind kind, int fd, uint32_t events, void *owner)
{
    *w = (struct watch){ .kind = kind, .fd = fd, .owner = owner };
    return watch_set(w, events);
}

static void watch_close(struct watch *w)
{
    if (w->fd < 0)
        return;
    watch_set(w, 0);
    close(w->fd);
    w->fd = -1;
}

/* ---- outbound frames ---- */

static void mark_dirty(struct conn *c)
{
    if (!c->dirty) {
        c->dirty = 1;
        c->next_dirty = dirty_conns;
        dirty_conns = c;
    }
}

static void put_header(unsigned char *h, uint8_t type, uint32_t stream, size_t payload)
{
    put_u32(h, (uint32_t)(payload + 5));
    h[4] = type;
    put_u32(h + 5, stream);
}

static void conn_close(struct conn *c);

static void send_frame(struct conn *c, uint8_t type, uint32_t stream, const void *payload, size_t len)
{
    if (!c || c->dead)
        return;
    if (buf_reserve(&c->out, FRAME_HEADER + len) < 0) {
        conn_close(c);
        return;
    }
    unsigned char *p = c->out.data + c->out.off + c->out.len;
    put_header(p, type, stream, len);
    if (len)
        memcpy(p + FRAME_HEADER, payload, len);
    c->out.len += FRAME_HEADER + len;
    mark_dirty(c);
}

static void send_spawn_error(struct conn *c, uint32_t stream, int err, const char *msg)
{
    unsigned char p[REAPER_MSG_MAX];
    size_t n = strnlen(msg, sizeof p - 4);
    put_u32(p, (uint32_t)err);
    memcpy(p + 4, msg, n);
    send_frame(c, F_SPAWN_ERROR, stream, p, 4 + n);
}

/* ---- commands ---- */

/* Output is read only after STARTED went out (frames keep their order) and while not paused. */
static void set_paused(struct cmd *m, int paused)
{
    m->paused = paused;
    uint32_t events = !paused && m->reported == 1 ? EPOLLIN : 0;
    watch_set(&m->out, events);
    watch_set(&m->err, events);
}

static void pause_conn_output(struct conn *c, int paused)
{
    for (struct cmd *m = cmds; m; m = m->next)
        if (m->conn == c && m->paused != paused)
            set_paused(m, paused);
}

static void ctl_send(struct cmd *m, const unsigned char *msg, size_t len)
{
    if (m->ctl.fd >= 0)
        send(m->ctl.fd, msg, len, MSG_DONTWAIT | MSG_NOSIGNAL);
}

static void kill_tree(struct cmd *m)
{
    unsigned char msg = F_KILL_TREE;
    ctl_send(m, &msg, 1);
}

static void set_stdin_full(struct cmd *m, int full)
{
    if (m->stdin_full == full)
        return;
    m->stdin_full = full;
    if (!m->conn)
        return;
    m->conn->ncmds_paused_stdin += full ? 1 : -1;
    watch_set(&m->conn->w, m->conn->ncmds_paused_stdin ? 0 : EPOLLIN);
}

static void close_stdin(struct cmd *m)
{
    set_stdin_full(m, 0);
    watch_close(&m->in);
    buf_free(&m->stdin_pending);
}

static void cmd_free_later(struct cmd *m)
{
    close_stdin(m);
    watch_close(&m->ctl); /* a reaper waiting for another command sees EOF and exits */
    if (m->reaper_pidfd >= 0)
        close(m->reaper_pidfd);
    m->reaper_pidfd = -1;
    watch_close(&m->out);
    watch_close(&m->err);
    if (m->prev)
        m->prev->next = m->next;
    else
        cmds = m->next;
    if (m->next)
        m->next->prev = m->prev;
    m->next = garbage_cmds;
    garbage_cmds = m;
}

/*
 * Reads one chunk of command output into the client's buffer (or discards it
 * when the client is gone). Returns the byte count, 0 on EAGAIN, -1 on EOF.
 */
static ssize_t read_output(struct cmd *m, struct watch *w)
{
    static unsigned char sink[READ_CHUNK];
    struct conn *c = m->conn;
    if (!c) {
        ssize_t n = read(w->fd, sink, sizeof sink);
        return n > 0 ? n : n < 0 && (errno == EAGAIN || errno == EINTR) ? 0 : -1;
    }
    if (buf_reserve(&c->out, FRAME_HEADER + READ_CHUNK) < 0) {
        conn_close(c);
        return 0;
    }
    unsigned char *h = c->out.data + c->out.off + c->out.len;
    ssize_t n = read(w->fd, h + FRAME_HEADER, READ_CHUNK);
    if (n <= 0) /* EIO is how a pty master says the slave side is gone */
        return n < 0 && (errno == EAGAIN || errno == EINTR) ? 0 : -1;
    put_header(h, w->kind == W_STDOUT ? F_STDOUT : F_STDERR, m->stream, (size_t)n);
    c->out.len += FRAME_HEADER + (size_t)n;
    mark_dirty(c);
    if (c->out.len >= OUT_HIGH)
        pause_conn_output(c, 1);
    return n;
}

/*
 * Sends EXIT and frees the command once the reaper has reported and its
 * output is drained: read to EOF, or to empty if background processes keep
 * the pipes open (a pty gets PTY_GRACE_MS for output still in the tty layer).
 * What the command left in its pipes is at most their capacity; DRAIN_MAX
 * bounds what background writers can add after the exit.
 */
#define DRAIN_MAX (4l << 20)
static void maybe_finish(struct cmd *m)
{
    if (!m->finished || m->paused)
        return;
    if (m->drain_left < 0)
        m->drain_left = DRAIN_MAX;
    struct watch *ws[2] = { &m->out, &m->err };
    for (int i = 0; i < 2; i++) {
        ssize_t r = 0;
        while (ws[i]->fd >= 0 && m->drain_left > 0 && (r = read_output(m, ws[i])) > 0) {
            m->drain_left -= r;
            if (m->paused)
                return; /* resumed (and finished) when the client drains */
        }
        if (ws[i]->fd < 0)
            continue;
        if (r < 0 || m->drain_left <= 0 || !(m->flags & SPAWN_PTY))
            watch_close(ws[i]);
        else if (!m->drain_deadline_ms)
            m->drain_deadline_ms = now_ms() + PTY_GRACE_MS;
        else if (now_ms() >= m->drain_deadline_ms)
            watch_close(ws[i]);
    }
    if (m->out.fd >= 0 || m->err.fd >= 0)
        return;
    if (m->reported == 1)
        send_frame(m->conn, F_EXIT, m->stream, m->exit_msg, EXIT_PAYLOAD);
    cmd_free_later(m);
}

/* ---- idle reapers ---- */

static void idle_unlink(struct idle_reaper *r)
{
    if (r->newer)
        r->newer->older = r->older;
    else
        idle_newest = r->older;
    if (r->older)
        r->older->newer = r->newer;
    else
        idle_oldest = r->newer;
    idle_count--;
}

/* Drops an idle reaper: its channel closes, so it exits. */
static void idle_drop(struct idle_reaper *r)
{
    idle_unlink(r);
    watch_close(&r->ctl);
    close(r->pidfd);
    r->newer = garbage_idle; /* a pending epoll event may still point at it */
    garbage_idle = r;
}

/*
 * The command's reaper offered to run another: its channel moves from the
 * command to the idle list (newest first), unless the list is full.
 */
static void keep_reaper(struct cmd *m)
{
    if (idle_count >= REAPER_POOL_MAX || m->reaper_pidfd < 0)
        return;
    struct idle_reaper *r = calloc(1, sizeof *r);
    if (!r)
        return;
    int fd = m->ctl.fd;
    watch_set(&m->ctl, 0);
    m->ctl.fd = -1;
    if (watch_add(&r->ctl, W_IDLE, fd, EPOLLIN, r) < 0) {
        close(fd);
        free(r);
        return;
    }
    r->pidfd = m->reaper_pidfd;
    m->reaper_pidfd = -1;
    r->since_ms = now_ms();
    r->older = idle_newest;
    if (idle_newest)
        idle_newest->newer = r;
    else
        idle_oldest = r;
    idle_newest = r;
    idle_count++;
}

/* Drops idle reapers kept longer than REAPER_IDLE_MS. */
static void expire_idle(long now)
{
    while (idle_oldest && now - idle_oldest->since_ms >= REAPER_IDLE_MS)
        idle_drop(idle_oldest);
}

/* A reaper message: [type][payload], forwarded to the client with the command's stream. */
static void on_ctl(struct cmd *m)
{
    unsigned char msg[REAPER_MSG_MAX];
    ssize_t n = recv(m->ctl.fd, msg, sizeof msg, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (n <= 0) {
        /* The reaper vanished without a report (killed from inside the sandbox). */
        if (!m->reported)
            send_spawn_error(m->conn, m->stream, ECHILD, "command reaper died");
        else if (!m->finished) {
            memset(m->exit_msg, 0, sizeof m->exit_msg);
            put_u32(m->exit_msg, SIGKILL); /* raw wait status: killed by SIGKILL */
        }
        m->reported = m->reported ? m->reported : 2;
        m->finished = 1;
        watch_close(&m->ctl);
    } else if (msg[0] == F_STARTED && !m->reported) {
        m->reported = 1;
        unsigned char started[STARTED_PAYLOAD] = { 0 };
        memcpy(started, msg + 1, (size_t)n - 1 < sizeof started ? (size_t)n - 1 : sizeof started);
        put_u32(started + 4, get_u32(started + 4) + m->reclaimed.killed);
        put_u32(started + 8, get_u32(started + 8) + m->reclaimed.groups);
        send_frame(m->conn, F_STARTED, m->stream, started, sizeof started);
        set_paused(m, m->paused);
        return;
    } else if (msg[0] == F_SPAWN_ERROR && !m->reported) {
        m->reported = 2;
        m->finished = 1;
        send_frame(m->conn, F_SPAWN_ERROR, m->stream, msg + 1, (size_t)n - 1);
    } else if (msg[0] == F_EXIT && (n == 1 + EXIT_PAYLOAD || n == 2 + EXIT_PAYLOAD) && m->reported == 1) {
        memcpy(m->exit_msg, msg + 1, EXIT_PAYLOAD);
        m->finished = 1;
        if (n == 2 + EXIT_PAYLOAD && msg[1 + EXIT_PAYLOAD] == 1)
            keep_reaper(m);
    } else {
        return;
    }
    close_stdin(m);
    maybe_finish(m);
}

static void flush_stdin(struct cmd *m)
{
    struct buf *b = &m->stdin_pending;
    while (b->len > 0) {
        ssize_t n = write(m->in.fd, b->data + b->off, b->len);
        if (n < 0) {
            if (errno == EAGAIN) {
                watch_set(&m->in, EPOLLOUT);
                set_stdin_full(m, b->len >= STDIN_HIGH);
                return;
            }
            close_stdin(m); /* EPIPE: the command closed its stdin; drop the rest */
            return;
        }
        buf_consume(b, (size_t)n);
    }
    watch_set(&m->in, 0);
    set_stdin_full(m, 0);
    if (m->stdin_eof)
        close_stdin(m);
}

/* ---- spawning ---- */

static int make_pipe(int fds[2])
{
    return pipe2(fds, O_CLOEXEC) < 0 ? -errno : 0;
}

/* Opens a pty pair in the sandbox's /dev/pts; master is non-blocking. Returns 0 or -errno. */
static int open_pty(uint16_t rows, uint16_t cols, int *master, int *slave)
{
    /* O_NONBLOCK: if the sandbox replaced /dev/ptmx with a FIFO, the open must not hang. */
    int m = open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC | O_NONBLOCK);
    if (m < 0)
        return -errno;
    int unlock = 0, ptn;
    struct winsize ws = { .ws_row = rows ? rows : 24, .ws_col = cols ? cols : 80 };
    if (ioctl(m, TIOCGPTN, &ptn) < 0 || ioctl(m, TIOCSPTLCK, &unlock) < 0 || ioctl(m, TIOCSWINSZ, &ws) < 0) {
        int err = errno;
        close(m);
        return -(err == ENOTTY ? ENODEV : err);
    }
    /* TIOCGPTPEER opens the slave through the master: no path lookup in the sandbox. */
    int s = ioctl(m, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (s < 0) {
        int err = errno;
        close(m);
        return -err;
    }
    *master = m;
    *slave = s;
    return 0;
}

/* The daemon's ends and the reaper's ends of one command's channels. */
struct channels {
    int ctl[2], in[2], out[2], err[2]; /* [0] daemon side, [1] reaper side */
};

/* Closes the reaper's ends (the pty slave may stand for several), and with `all` ours too. */
static void close_ends(struct channels *ch, int all)
{
    int *fds[] = { &ch->ctl[1], &ch->in[1], &ch->out[1], &ch->err[1], &ch->ctl[0], &ch->in[0], &ch->out[0], &ch->err[0] };
    for (int i = 0; i < (all ? 8 : 4); i++) {
        int fd = *fds[i];
        if (fd < 0)
            continue;
        close(fd);
        for (int j = i; j < 8; j++)
            if (*fds[j] == fd)
                *fds[j] = -1;
    }
}

static void close_channels(struct channels *ch)
{
    close_ends(ch, 1);
}

/* The command's channels; the control socket only with `ctl` (an idle reaper has its own). */
static int open_channels(const struct spawn_request *req, struct channels *ch, int ctl)
{
    memset(ch, -1, sizeof *ch);
    int r = ctl && socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, ch->ctl) < 0 ? -errno : 0;
    if (!r && (req->flags & SPAWN_PTY)) {
        /* The slave is all three of the command's stdio; STDIN frames go to the master. */
        if (!(r = open_pty(req->rows, req->cols, &ch->out[0], &ch->out[1]))) {
            ch->in[1] = ch->err[1] = ch->out[1];
            if ((req->flags & SPAWN_STDIN) && (ch->in[0] = fcntl(ch->out[0], F_DUPFD_CLOEXEC, 0)) < 0)
                r = -errno;
        }
    } else if (!r && (req->flags & SPAWN_STDIN) && !(r = make_pipe(ch->in))) {
        int rd = ch->in[0];
        ch->in[0] = ch->in[1]; /* we write */
        ch->in[1] = rd;
    }
    if (!r && !(req->flags & SPAWN_PTY) && !(r = make_pipe(ch->out)) && !(r = make_pipe(ch->err))) {
        /* Larger pipes mean fewer wake-ups per byte on bulk output. */
        fcntl(ch->out[1], F_SETPIPE_SZ, STDOUT_PIPE_SIZE);
    }
    if (r < 0)
        close_channels(ch);
    return r;
}

/*
 * Hands a command to the newest idle reaper: REAPER_RUN with the SPAWN
 * payload and the reaper's ends of its pipes. Returns the reaper's channel
 * (now the command's), or -1 when no idle reaper took it.
 */
static int run_on_idle_reaper(const unsigned char *payload, size_t len, const struct channels *ch, int *pidfd)
{
    while (idle_newest) {
        struct idle_reaper *r = idle_newest;
        /* Continued first: a process of the sandbox may have stopped it while it waited. */
        syscall(SYS_pidfd_send_signal, r->pidfd, SIGCONT, NULL, 0);
        unsigned char type = REAPER_RUN;
        struct iovec iov[2] = { { .iov_base = &type, .iov_len = 1 }, { .iov_base = (void *)payload, .iov_len = len } };
        int fds[3], nfds = 0;
        if (ch->in[1] >= 0)
            fds[nfds++] = ch->in[1];
        fds[nfds++] = ch->out[1];
        fds[nfds++] = ch->err[1];
        union {
            struct cmsghdr h;
            char space[CMSG_SPACE(3 * sizeof(int))];
        } control;
        memset(&control, 0, sizeof control);
        struct msghdr mh = { .msg_iov = iov, .msg_iovlen = 2, .msg_control = &control,
                             .msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int)) };
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
        memcpy(CMSG_DATA(c), fds, (size_t)nfds * sizeof(int));
        if (sendmsg(r->ctl.fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
            idle_drop(r); /* it died meanwhile (or its buffer is full): try the next one */
            continue;
        }
        int fd = r->ctl.fd;
        watch_set(&r->ctl, 0);
        r->ctl.fd = -1;
        *pidfd = r->pidfd;
        idle_unlink(r);
        free(r);
        return fd;
    }
    return -1;
}

static void spawn(struct conn *c, uint32_t stream, const struct spawn_request *req, const unsigned char *payload,
                  size_t len)
{
    /* A plain command goes to an idle reaper when there is one: no fork. */
    int reuse = idle_newest && !(req->flags & (SPAWN_PTY | SPAWN_DETACHED)) && len <= REAPER_RUN_MAX;
    struct channels ch;
    int r = open_channels(req, &ch, !reuse);
    if (r < 0) {
        send_spawn_error(c, stream, -r, "cannot set up command channels");
        return;
    }
    struct reclaim_stats reclaimed = { 0 };
    int pidfd = -1;
    if (reuse && (ch.ctl[0] = run_on_idle_reaper(payload, len, &ch, &pidfd)) < 0) {
        reuse = 0; /* every idle reaper had gone: a new one after all */
        if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, ch.ctl) < 0) {
            int err = errno;
            close_channels(&ch);
            send_spawn_error(c, stream, err, "cannot set up command channels");
            return;
        }
    }
    if (!reuse) {
        /* At the sandbox's pids limit this kills leftovers (blocking the loop for at most
           its bounded budget): the platform's command must not be the one that fails. */
        pid_t pid = fork_reclaiming(&reclaimed);
        if (pid == 0) {
            struct reaper_fds fds = { .ctl = ch.ctl[1], .stdin_r = ch.in[1], .stdout_w = ch.out[1],
                                      .stderr_w = ch.err[1], .shell_memfd = state->shell_memfd };
            reaper_main(req, &fds);
        }
        int err = errno;
        if (pid < 0) {
            close_channels(&ch);
            send_spawn_error(c, stream, err, err == EAGAIN ? "fork: the sandbox's process limit is reached" : "fork");
            return;
        }
        pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    }
    close_ends(&ch, 0);
    struct cmd *m = calloc(1, sizeof *m);
    if (!m)
        abort(); /* the reaper would be orphaned; nothing sensible left to do */
    m->conn = c;
    m->stream = stream;
    m->flags = req->flags;
    m->in.fd = m->err.fd = -1;
    m->drain_left = -1;
    m->reclaimed = reclaimed;
    m->reaper_pidfd = pidfd;
    fcntl(ch.out[0], F_SETFL, O_NONBLOCK);
    watch_add(&m->ctl, W_CTL, ch.ctl[0], EPOLLIN, m);
    watch_add(&m->out, W_STDOUT, ch.out[0], 0, m); /* enabled by STARTED */
    if (ch.err[0] >= 0) {
        fcntl(ch.err[0], F_SETFL, O_NONBLOCK);
        watch_add(&m->err, W_STDERR, ch.err[0], 0, m);
    }
    if (ch.in[0] >= 0) {
        fcntl(ch.in[0], F_SETFL, O_NONBLOCK);
        watch_add(&m->in, W_STDIN, ch.in[0], 0, m);
    }
    m->next = cmds;
    if (cmds)
        cmds->prev = m;
    cmds = m;
    m->paused = c->out.len >= OUT_HIGH;
}

/* ---- client frames ---- */

static struct cmd *find_cmd(struct conn *c, uint32_t stream)
{
    for (struct cmd *m = cmds; m; m = m->next)
        if (m->conn == c && m->stream == stream)
            return m;
    return NULL;
}

static void on_spawn(struct conn *c, uint32_t stream, unsigned char *p, size_t len)
{
    if (find_cmd(c, stream)) {
        send_spawn_error(c, stream, EEXIST, "stream id already in use");
        return;
    }
    struct spawn_request req;
    if (spawn_request_parse(p, len, &req) < 0) {
        send_spawn_error(c, stream, EINVAL, "malformed SPAWN frame");
        return;
    }
    spawn(c, stream, &req, p, len);
    spawn_request_free(&req);
}

static void on_frame(struct conn *c, uint8_t type, uint32_t stream, unsigned char *p, size_t len)
{
    if (type == F_SPAWN) {
        on_spawn(c, stream, p, len);
        return;
    }
    struct cmd *m = find_cmd(c, stream);
    if (!m)
        return; /* finished already, or never existed: nothing to act on */
    switch (type) {
    case F_STDIN:
        if (m->in.fd >= 0 && !m->stdin_eof && len) {
            if (buf_reserve(&m->stdin_pending, len) < 0) {
                conn_close(c);
                return;
            }
            memcpy(m->stdin_pending.data + m->stdin_pending.off + m->stdin_pending.len, p, len);
            m->stdin_pending.len += len;
            flush_stdin(m);
        }
        break;
    case F_STDIN_EOF:
        if (m->in.fd >= 0 && !m->stdin_eof && (m->flags & SPAWN_PTY)) {
            /* A terminal has no EOF of its own: send the VEOF character (^D). */
            static const unsigned char veof = 4;
            if (buf_reserve(&m->stdin_pending, 1) == 0)
                m->stdin_pending.data[m->stdin_pending.off + m->stdin_pending.len++] = veof;
        }
        m->stdin_eof = 1;
        if (m->in.fd >= 0)
            flush_stdin(m);
        break;
    case F_SIGNAL:
        if (len >= 4) {
            unsigned char msg[5] = { F_SIGNAL };
            memcpy(msg + 1, p, 4);
            ctl_send(m, msg, sizeof msg);
        }
        break;
    case F_KILL_TREE:
        kill_tree(m);
        break;
    case F_RESIZE:
        if (len >= 4 && (m->flags & SPAWN_PTY) && m->out.fd >= 0) {
            struct winsize ws = { .ws_row = get_u16(p), .ws_col = get_u16(p + 2) };
            ioctl(m->out.fd, TIOCSWINSZ, &ws);
        }
        break;
    default:
        break; /* unknown types are ignored, for forward compatibility */
    }
}

/* Parses every complete frame in c->in; returns -1 on a protocol violation. */
static int parse_frames(struct conn *c)
{
    struct buf *b = &c->in;
    while (b->len >= 4 && !c->dead) {
        unsigned char *f = b->data + b->off;
        uint32_t flen = get_u32(f);
        if (flen < 5 || flen - 5 > MAX_PAYLOAD)
            return -1;
        if (b->len < 4 + (size_t)flen)
            break;
        on_frame(c, f[4], get_u32(f + 5), f + FRAME_HEADER, flen - 5);
        if (c->dead)
            break;
        buf_consume(b, 4 + (size_t)flen);
    }
    return 0;
}

/* ---- connections ---- */

static void conn_close(struct conn *c)
{
    if (c->dead)
        return;
    c->dead = 1;
    for (struct cmd *m = cmds; m; m = m->next) {
        if (m->conn != c)
            continue;
        close_stdin(m);
        m->conn = NULL; /* output is discarded from now on */
        if (m->paused)
            set_paused(m, 0);
        if (!(m->flags & SPAWN_DETACHED))
            kill_tree(m);
    }
    watch_close(&c->w);
    /* Buffers are freed with the struct: a frame being parsed may point into c->in. */
    c->next_garbage = garbage_conns; /* dirty_conns skips dead ones */
    garbage_conns = c;
}

static void on_conn_readable(struct conn *c)
{
    if (buf_reserve(&c->in, READ_CHUNK) < 0) {
        conn_close(c);
        return;
    }
    ssize_t n = read(c->w.fd, c->in.data + c->in.off + c->in.len, READ_CHUNK);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (n <= 0) {
        conn_close(c);
        return;
    }
    c->in.len += (size_t)n;
    if (parse_frames(c) < 0)
        conn_close(c);
}

static void flush_conn(struct conn *c)
{
    while (c->out.len > 0) {
        ssize_t n = write(c->w.fd, c->out.data + c->out.off, c->out.len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN)
                conn_close(c);
            break;
        }
        buf_consume(&c->out, (size_t)n);
    }
    if (c->dead)
        return;
    uint32_t in = c->ncmds_paused_stdin ? 0 : EPOLLIN;
    watch_set(&c->w, in | (c->out.len ? EPOLLOUT : 0));
    if (c->out.len < OUT_HIGH / 2) {
        for (struct cmd *m = cmds, *next; m; m = next) {
            next = m->next;
            if (m->conn == c && m->paused) {
                set_paused(m, 0);
                maybe_finish(m);
            }
        }
    }
}

static void on_listen(void)
{
    for (;;) {
        int fd = accept4(state->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return; /* EAGAIN, or a transient error such as EMFILE: retried on the next event */
        struct conn *c = calloc(1, sizeof *c);
        if (!c || watch_add(&c->w, W_CONN, fd, EPOLLIN, c) < 0) {
            free(c);
            close(fd);
            continue;
        }
    }
}

/* ---- main loop ---- */

/* The sandbox init died: the sandbox is gone, so is every command tree. */
static _Noreturn void shut_down(void)
{
    for (struct cmd *m = cmds; m; m = m->next)
        kill_tree(m);
    struct stat sb;
    if (fstatat(state->sock_dirfd, state->sock_name, &sb, AT_SYMLINK_NOFOLLOW) == 0 && sb.st_ino == state->sock_ino)
        unlinkat(state->sock_dirfd, state->sock_name, 0);
    exit(0);
}

static void dispatch(struct watch *w, uint32_t events)
{
    if (w->fd < 0)
        return; /* closed earlier in this round */
    struct cmd *m = w->owner;
    switch (w->kind) {
    case W_LISTEN:
        on_listen();
        break;
    case W_INIT:
        shut_down();
    case W_CONN:
        if (events & (EPOLLIN | EPOLLHUP | EPOLLERR))
            on_conn_readable(w->owner);
        if (w->fd >= 0 && (events & EPOLLOUT))
            mark_dirty(w->owner);
        break;
    case W_CTL:
        on_ctl(m);
        break;
    case W_IDLE:
        idle_drop(w->owner); /* it died, or said something out of turn */
        break;
    case W_STDIN:
        if (events & EPOLLERR)
            close_stdin(m); /* the command closed its stdin */
        else
            flush_stdin(m);
        break;
    case W_STDOUT:
    case W_STDERR:
        /* A few reads per wake-up: fewer epoll rounds on bulk output. */
        for (int i = 0; i < 4 && w->fd >= 0 && !m->paused; i++) {
            ssize_t r = read_output(m, w);
            if (r < 0)
                watch_close(w);
            if (r <= 0)
                break;
        }
        maybe_finish(m);
        break;
    }
}

static int next_timeout(void)
{
    long soonest = idle_oldest ? idle_oldest->since_ms + REAPER_IDLE_MS : -1, now = now_ms();
    for (struct cmd *m = cmds; m; m = m->next)
        if (m->drain_deadline_ms && (soonest < 0 || m->drain_deadline_ms < soonest))
            soonest = m->drain_deadline_ms;
    return soonest < 0 ? -1 : soonest <= now ? 0 : (int)(soonest - now);
}

static void collect_garbage(void)
{
    while (garbage_idle) {
        struct idle_reaper *r = garbage_idle;
        garbage_idle = r->newer;
        free(r);
    }
    while (garbage_cmds) {
        struct cmd *m = garbage_cmds;
        garbage_cmds = m->next;
        free(m);
    }
    while (garbage_conns) {
        struct conn *c = garbage_conns;
        garbage_conns = c->next_garbage;
        buf_free(&c->in);
        buf_free(&c->out);
        free(c);
    }
}

_Noreturn void chronus_serve(const struct chronus_state *st)
{
    state = st;
    epfd = epoll_create1(EPOLL_CLOEXEC);
    static struct watch listen_w, init_w;
    if (epfd < 0 || watch_add(&listen_w, W_LISTEN, st->listen_fd, EPOLLIN, NULL) < 0 ||
        watch_add(&init_w, W_INIT, st->init_pidfd, EPOLLIN, NULL) < 0)
        exit(1);
    struct epoll_event evs[64];
    for (;;) {
        int n = epoll_wait(epfd, evs, 64, next_timeout());
        for (int i = 0; i < n; i++)
            dispatch(evs[i].data.ptr, evs[i].events);
        for (struct cmd *m = cmds, *next; m; m = next) {
            next = m->next;
            if (m->drain_deadline_ms && now_ms() >= m->drain_deadline_ms)
                maybe_finish(m);
        }
        expire_idle(now_ms());
        while (dirty_conns) {
            struct conn *c = dirty_conns;
            dirty_conns = c->next_dirty;
            c->dirty = 0;
            if (!c->dead)
                flush_conn(c);
        }
        collect_garbage();
    }
}
