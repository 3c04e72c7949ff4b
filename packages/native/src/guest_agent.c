/*
 * dsec-guest-agent: PID 1 of a microVM sandbox (the kernel's `rdinit`). It
 * loads the modules the cloud kernel lacks, mounts the sandbox root (the
 * image's EROFS layers and the writable ext4 disk under an overlay, the
 * kernel filesystems inside it, a pids cgroup) and then serves commands.
 *
 * The host has no vsock here, only virtio-serial ports: each port carries one
 * chronus connection at a time (the host end is a QEMU chardev socket the
 * edge connects to with the ordinary chronus client). Rather than teach the
 * chronus event loop about ports, the agent runs that loop unchanged
 * (chronus_loop.c, reaper.c) in a child chroot'ed into ROOT and listening on
 * a unix socket of the initramfs, and relays each port to its own connection
 * to that socket. A host disconnect on a port closes its relayed connection,
 * which is exactly what closing a chronus socket means (non-detached commands
 * are killed); the next host connection gets a fresh one.
 *
 * PID 1 also reaps orphans (they re-parent to it). It must not exit (the
 * guest kernel would panic): a fatal error powers the VM off instead, which
 * the host sees as QEMU ending. The host stops a sandbox by ending QEMU.
 *
 * Usage: dsec-guest-agent ROOT SHELLBIN (ROOT already mounted), or with
 * no arguments as the kernel's `rdinit`: it then mounts the sandbox root
 * itself at /newroot (setup_root) and serves /bin/busybox as the shell.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/netlink.h>
#include <net/if.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "chronus.h"
#include "util.h"

#define SOCK_PATH "/run/dsec-agent.sock"
#define MAX_PORTS 32
#define RELAY_BUF 65536u
/*
 * poll() reports a port without a host connection as hung up at once, so
 * the loop cannot wait in poll for the host to come. The driver sends SIGIO
 * instead (O_ASYNC) when the host side opens or closes, and ports that
 * appear later (hot-plugged by the host, or named after the agent looked)
 * come as uevents. Only where either is unavailable does the loop look
 * again this often (IDLE_RECHECK_MS wakes an idle guest: costly under TCG).
 */
#define IDLE_RECHECK_MS 5
#define PORT_RESCAN_MS 500
/* How long after the agent serves the modules no command needs are loaded. */
#define LATE_MODULES_DELAY_S 2

struct port {
    int fd;    /* the virtio-serial port */
    int conn;  /* relayed chronus connection, -1 while the host is away */
    int up;    /* the host end is connected */
    unsigned char to_conn[RELAY_BUF], to_port[RELAY_BUF];
    size_t to_conn_len, to_conn_off, to_port_len, to_port_off;
};

static struct port ports[MAX_PORTS];
static int nports;
/* Kernel uevents (ports added or named since the last look), or -1. */
static int uevent_fd = -1;
/* Every open port signals its host's comings and goings (SIGIO). */
static int ports_async = 1;

#define SANDBOX_CGROUP "/sys/fs/cgroup/sandbox"

static int write_file(const char *path, const char *value)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int r = write_all(fd, value, strlen(value));
    close(fd);
    return r < 0 ? -1 : 0;
}

static int seal_shell(const char *path)
{
    int src = open(path, O_RDONLY | O_CLOEXEC);
    if (src < 0)
        dief(errno, "open shell %s", path);
    int mfd = memfd_create("dsec-shell", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (mfd < 0)
        die("memfd_create", errno);
    char buf[65536];
    ssize_t n;
    while ((n = read(src, buf, sizeof buf)) > 0)
        if (write_all(mfd, buf, (size_t)n) < 0)
            die("write shell memfd", errno);
    close(src);
    if (fcntl(mfd, F_ADD_SEALS, F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE) < 0)
        die("seal shell memfd", errno);
    return mfd;
}

static int listen_socket(void)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    strcpy(addr.sun_path, SOCK_PATH);
    mkdir("/run", 0700);
    unlink(SOCK_PATH);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(fd, 128) < 0)
        die("listen " SOCK_PATH, errno);
    chmod(SOCK_PATH, 0600);
    return fd;
}

/* Seconds since the guest kernel started, for the boot breakdown on the console. */
static double uptime_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int open_uevents(void)
{
    int fd = socket(AF_NETLINK, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, NETLINK_KOBJECT_UEVENT);
    struct sockaddr_nl sa = { .nl_family = AF_NETLINK, .nl_groups = 1 };
    if (fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

/* Reads the pending uevents: only that something changed matters (the caller looks again). */
static void drain_uevents(void)
{
    char buf[8192];
    while (uevent_fd >= 0) {
        ssize_t n = recv(uevent_fd, buf, sizeof buf, 0);
        if (n <= 0 && !(n < 0 && errno == ENOBUFS)) /* ENOBUFS: some were lost, which is no matter */
            break;
    }
}

/*
 * Opens the ports the host named `dsec.N` (vportXpY, whatever X and Y) that
 * are not open yet: index N is the host's too. The driver adds ports one at
 * a time as it handles the host's control messages (at boot, or when the
 * host hot-plugs one), and each gets its name later still (a uevent
 * "change"), so one look may find only some: the main loop looks again on
 * every uevent (a port never opened leaves every host connection to it
 * unanswered: the full VM's agent starts while udev is still loading
 * virtio_console).
 */
static void scan_ports(void)
{
    DIR *d = opendir("/sys/class/virtio-ports");
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char path[300], name[64];
        snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/name", e->d_name);
        FILE *f = fopen(path, "re");
        if (!f)
            continue;
        int idx = -1;
        if (fgets(name, sizeof name, f) && sscanf(name, "dsec.%d", &idx) == 1 && idx >= 0 && idx < MAX_PORTS &&
            ports[idx].fd < 0) {
            snprintf(path, sizeof path, "/dev/%s", e->d_name);
            int fd = open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
            if (fd >= 0) {
                /* SIGIO to the agent when the host side opens or closes (the driver's PORT_OPEN). */
                int fl = fcntl(fd, F_GETFL);
                if (fl < 0 || fcntl(fd, F_SETOWN, getpid()) < 0 || fcntl(fd, F_SETFL, fl | O_ASYNC) < 0)
                    ports_async = 0;
                ports[idx].fd = fd;
                if (idx + 1 > nports)
                    nports = idx + 1;
            }
        }
        fclose(f);
    }
    if (d)
        closedir(d);
}

/*
 * Waits for the shared port, dsec.0 (the console driver probes in the
 * background, and the host names the port after it appeared); the others
 * come as they come. A boot has many uevents: the wait is bounded in time.
 */
#define PORT0_WAIT_S 30
static void open_ports(void)
{
    uevent_fd = open_uevents();
    double deadline = uptime_s() + PORT0_WAIT_S;
    for (;;) {
        scan_ports();
        if (ports[0].fd >= 0)
            return;
        if (uptime_s() > deadline)
            die("no virtio-serial port named dsec.0", ENODEV);
        struct pollfd q = { .fd = uevent_fd, .events = POLLIN };
        if (uevent_fd < 0)
            usleep(10000);
        else
            (void)poll(&q, 1, 10);
        drain_uevents();
    }
}

/* PID 1 must not exit (the kernel panics): a fatal error powers the VM off, which the host sees. */
static void power_off(void)
{
    if (getpid() == 1) {
        sync();
        reboot(RB_POWER_OFF);
    }
}

static int connect_agent(void)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    strcpy(addr.sun_path, SOCK_PATH);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0 && errno != EINPROGRESS) {
        close(fd);
        return -1;
    }
    return fd;
}

static void port_down(struct port *p)
{
    if (p->conn >= 0)
        close(p->conn);
    p->conn = -1;
    p->up = 0;
    p->to_conn_len = p->to_conn_off = p->to_port_len = p->to_port_off = 0;
}

/* Moves what is buffered for `fd`; -1 when `fd` failed. */
static int flush(int fd, unsigned char *buf, size_t *off, size_t *len)
{
    while (*len > 0) {
        ssize_t n = write(fd, buf + *off, *len);
        if (n < 0)
            return errno == EAGAIN || errno == EINTR ? 0 : -1;
        *off += (size_t)n;
        *len -= (size_t)n;
    }
    *off = 0;
    return 0;
}

static _Noreturn void serve_chronus(const char *root, int listen_fd, int shell_memfd)
{
    static struct chronus_state st;
    st.listen_fd = listen_fd;
    st.shell_memfd = shell_memfd;
    st.sock_dirfd = open("/run", O_PATH | O_DIRECTORY | O_CLOEXEC);
    st.sock_name = "dsec-agent.sock";
    struct stat sb;
    st.sock_ino = stat(SOCK_PATH, &sb) == 0 ? sb.st_ino : 0;
    /* PID 1 never exits while the VM runs: the loop's "init died" never fires. */
    st.init_pidfd = (int)syscall(SYS_pidfd_open, 1, 0);
    if (st.init_pidfd < 0)
        die("pidfd_open 1", errno);
    struct stat cg;
    if (stat(SANDBOX_CGROUP, &cg) == 0 && write_file(SANDBOX_CGROUP "/cgroup.procs", "0") < 0)
        die("join the sandbox's pids cgroup", errno);
    if (chdir(root) < 0 || chroot(".") < 0 || chdir("/") < 0)
        dief(errno, "chroot %s", root);
    set_process_title(CHRONUS_TITLE);
    chronus_serve(&st);
}

/* ---- the sandbox root, when the agent is the kernel's rdinit ---- */


static void must_mount(const char *src, const char *dst, const char *type, unsigned long flags, const char *data)
{
    mkdir(dst, 0755);
    if (mount(src, dst, type, flags, data) < 0)
        dief(errno, "mount %s on %s (%s)", src, dst, type);
}

/* Block devices appear as the virtio drivers probe: wait for one briefly. */
static void wait_for(const char *dev)
{
    struct stat sb;
    for (int i = 0; i < 2500 && stat(dev, &sb) < 0; i++)
        usleep(2000);
    if (stat(dev, &sb) < 0)
        dief(errno, "no %s", dev);
}

/* Loads the modules a list of the initramfs names, in order. */
static void load_modules(const char *list)
{
    FILE *f = fopen(list, "re");
    char name[128];
    while (f && fgets(name, sizeof name, f)) {
        name[strcspn(name, "\n")] = 0;
        char path[200];
        snprintf(path, sizeof path, "/modules/%s", name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        /*
         * The console's ports are set up in the background (its probe and
         * the host's port messages): the next modules load and the root is
         * mounted meanwhile, and open_ports waits for the port. Not the
         * disks: the order they probe in names them (vda… in drive order).
         */
        const char *params = strcmp(name, "virtio_console.ko") == 0 ? "async_probe=1" : "";
        if (fd < 0 || (syscall(SYS_finit_module, fd, params, 0) < 0 && errno != EEXIST))
            dief(errno, "load module %s", name);
        close(fd);
    }
    if (f)
        fclose(f);
}

/*
 * The VM's network (ADR 0016), when the edge gave it one: `dsec.net=eth0,
 * ADDR/PLEN,GATEWAY[,ADDR6/PLEN,GATEWAY6]` and `dsec.dns=RESOLVER` on the
 * kernel command line. The virtio-net driver is loaded only then (a VM
 * without a network boots without it), eth0 is configured with the same
 * netlink messages a container's chronus daemon sends (chronus_net.c), and
 * the sandbox's /etc/resolv.conf becomes a read-only bind of a file naming
 * the edge's resolver (kept out of the writable layer, as in a container).
 * Nothing here is a boundary: the guest's root may change all of it, and
 * the host's firewall on the tap binds the VM to its address and policy.
 */
static void setup_net(const char *root, const char *cmdline)
{
    const char *np = strstr(cmdline, "dsec.net=");
    if (!np)
        return;
    char line[256];
    snprintf(line, sizeof line, "%s", np + strlen("dsec.net="));
    line[strcspn(line, " \n")] = 0;
    for (char *c = line; *c; c++)
        if (*c == ',')
            *c = ' ';
    struct chronus_net cfg;
    if (chronus_net_parse(line, &cfg) < 0)
        dief(EINVAL, "dsec.net=%s", np + strlen("dsec.net="));
    load_modules("/modules.net");
    char dev[64];
    snprintf(dev, sizeof dev, "/sys/class/net/%s", cfg.ifname);
    wait_for(dev);
    char err[160];
    int r = chronus_net_apply(&cfg, err, sizeof err);
    if (r < 0)
        dief(-r, "%s", err);
    const char *dp = strstr(cmdline, "dsec.dns=");
    if (!dp)
        return;
    char dns[64], conf[128], p[256];
    snprintf(dns, sizeof dns, "%s", dp + strlen("dsec.dns="));
    dns[strcspn(dns, " \n")] = 0;
    int n = snprintf(conf, sizeof conf, "nameserver %s\noptions timeout:2 attempts:2\n", dns);
    int fd = open("/run/resolv.conf", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || write_all(fd, conf, (size_t)n) < 0)
        die("write /run/resolv.conf", errno);
    close(fd);
    snprintf(p, sizeof p, "%s/etc", root);
    mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/etc/resolv.conf", root);
    /* A symlink (systemd-resolved images) would lead the bind elsewhere: replace it. */
    struct stat sb;
    if (lstat(p, &sb) == 0 && !S_ISREG(sb.st_mode))
        unlink(p);
    fd = open(p, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0)
        close(fd);
    if (mount("/run/resolv.conf", p, NULL, MS_BIND, NULL) < 0 ||
        mount(NULL, p, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY, NULL) < 0)
        die("bind resolv.conf", errno);
}

/*
 * What the initramfs's /init script does, without a fork per step (each
 * fork and exec of busybox costs milliseconds under TCG): the modules of
 * /modules.order, the EROFS layers (drives vda… in `dsec.layers`, top
 * first), the writable ext4 disk after them, the overlay at ROOT and the
 * kernel filesystems inside it.
 */
static void setup_root(const char *root)
{
    must_mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    must_mount("sys", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    must_mount("dev", "/dev", "devtmpfs", MS_NOSUID, NULL);
    char cmdline[4096] = "";
    FILE *f = fopen("/proc/cmdline", "re");
    if (f) {
        if (!fgets(cmdline, sizeof cmdline, f))
            cmdline[0] = 0;
        fclose(f);
    }
    const char *lp = strstr(cmdline, "dsec.layers=");
    int nlayers = lp ? atoi(lp + strlen("dsec.layers=")) : 0;
    const char *pp = strstr(cmdline, "dsec.pids=");
    long pids = pp ? atol(pp + strlen("dsec.pids=")) : 0;
    if (nlayers < 1 || nlayers > 24)
        dief(EINVAL, "dsec.layers=%d", nlayers);

    load_modules("/modules.order");
    fprintf(stderr, "dsec-guest-agent: modules loaded at %.3f s\n", uptime_s());

    char lower[24 * 16] = "", dev[16], dir[32];
    for (int i = 0; i < nlayers; i++) {
        snprintf(dev, sizeof dev, "/dev/vd%c", 'a' + i);
        snprintf(dir, sizeof dir, "/layers/%d", i);
        wait_for(dev);
        must_mount(dev, dir, "erofs", MS_RDONLY, NULL);
        snprintf(lower + strlen(lower), sizeof lower - strlen(lower), "%s%s", i ? ":" : "", dir);
    }
    snprintf(dev, sizeof dev, "/dev/vd%c", 'a' + nlayers);
    wait_for(dev);
    /*
     * noinit_itable: the disk is a fresh sparse file (zeros), so the inode
     * tables mkfs left uninitialised are zero already; without it the guest
     * spends its first seconds (under TCG) zeroing them in the background.
     */
    must_mount(dev, "/rw", "ext4", MS_NOATIME, "noinit_itable");
    mkdir("/rw/upper", 0755);
    mkdir("/rw/work", 0700);
    char opts[600];
    snprintf(opts, sizeof opts, "lowerdir=%s,upperdir=/rw/upper,workdir=/rw/work", lower);
    must_mount("overlay", root, "overlay", 0, opts);
    char p[256];
#define IN_ROOT(sub) (snprintf(p, sizeof p, "%s%s", root, sub), p)
    must_mount("proc", IN_ROOT("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    must_mount("sys", IN_ROOT("/sys"), "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    must_mount("dev", IN_ROOT("/dev"), "devtmpfs", MS_NOSUID, NULL);
    must_mount("tmp", IN_ROOT("/tmp"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
    must_mount("devpts", IN_ROOT("/dev/pts"), "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5");
    unlink(IN_ROOT("/dev/ptmx"));
    if (symlink("pts/ptmx", IN_ROOT("/dev/ptmx")) < 0)
        die("symlink /dev/ptmx", errno);
    must_mount("shm", IN_ROOT("/dev/shm"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
#undef IN_ROOT
    /*
     * The sandbox's pids limit: a cgroup of the guest's own hierarchy (mounted
     * outside ROOT: the sandbox does not see it) that the chronus loop joins,
     * so every command and what it forks counts, and the loop's reclaiming at
     * the limit (reaper.c) works as in a container. PID 1 stays outside.
     */
    if (pids > 0) {
        must_mount("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
        char v[32];
        snprintf(v, sizeof v, "%ld", pids);
        if (mkdir(SANDBOX_CGROUP, 0755) < 0 || write_file("/sys/fs/cgroup/cgroup.subtree_control", "+pids") < 0 ||
            write_file(SANDBOX_CGROUP "/pids.max", v) < 0)
            die("pids cgroup", errno);
    }
    sethostname("sandbox", 7);
    setup_net(root, cmdline);
    /* Loopback up (again, if setup_net did): the only interface without a network. */
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq ifr = { 0 };
    strcpy(ifr.ifr_name, "lo");
    if (s >= 0 && ioctl(s, SIOCGIFFLAGS, &ifr) == 0) {
        ifr.ifr_flags |= IFF_UP;
        (void)ioctl(s, SIOCSIFFLAGS, &ifr);
    }
    if (s >= 0)
        close(s);
}

int main(int argc, char **argv)
{
    save_argv(argc, argv);
    if (getpid() == 1)
        atexit(power_off);
    const char *root, *shell;
    if (argc == 1 && getpid() == 1) {
        /* The kernel's rdinit (no arguments): set the sandbox root up first. */
        root = "/newroot";
        shell = "/bin/busybox";
        fprintf(stderr, "dsec-guest-agent: started at %.3f s\n", uptime_s());
        setup_root(root);
        fprintf(stderr, "dsec-guest-agent: root mounted at %.3f s\n", uptime_s());
    } else if (argc == 3) {
        root = argv[1];
        shell = argv[2];
    } else {
        fprintf(stderr, "usage: dsec-guest-agent [ROOT SHELLBIN]\n");
        return 2;
    }
    for (int i = 0; i < MAX_PORTS; i++)
        ports[i].fd = ports[i].conn = -1;
    /*
     * The shell commands run with (`shell: true`): as rdinit, the
     * initramfs's busybox, outside the sandbox's root and not writable
     * from it, so it needs no sealed copy (copying 2 MB costs tens of ms
     * under TCG); given as an argument (the full VM), a sealed copy.
     */
    int shell_memfd = argc == 1 ? open(shell, O_RDONLY | O_CLOEXEC) : seal_shell(shell);
    if (shell_memfd < 0)
        dief(errno, "open shell %s", shell);
    int listen_fd = listen_socket();
    reaper_default_signals(); /* a service manager may have ignored some (chronus.h) */
    signal(SIGPIPE, SIG_IGN);

    /* SIGCHLD: orphans to reap; SIGIO: a port's host side opened or closed (scan_ports). */
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigaddset(&chld, SIGIO);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    int sfd = signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC);

    pid_t server = fork();
    if (server == 0) {
        sigprocmask(SIG_UNBLOCK, &chld, NULL);
        serve_chronus(root, listen_fd, shell_memfd);
    }
    close(listen_fd);
    open_ports();
    fprintf(stderr, "dsec-guest-agent: serving %d ports at %.3f s\n", nports, uptime_s());
    /*
     * Modules no command needs first (the memory balloon, whose free-page
     * reporting gives the host back what the guest frees): a child loads
     * them a little after the first commands ran. Its failure is only logged (a
     * child's exit does not power off: power_off checks for PID 1).
     */
    if (getpid() == 1 && fork() == 0) {
        /* After the boot's first commands: under TCG the one vCPU would load them instead of serving. */
        sleep(LATE_MODULES_DELAY_S);
        load_modules("/modules.late");
        _exit(0);
    }

    struct pollfd pfd[2 + 2 * MAX_PORTS];
    double last_scan = uptime_s();
    for (;;) {
        int n = 0, idle = 0;
        pfd[n++] = (struct pollfd){ .fd = sfd, .events = POLLIN };
        pfd[n++] = (struct pollfd){ .fd = uevent_fd, .events = POLLIN }; /* ignored while -1 */
        for (int i = 0; i < nports; i++) {
            struct port *p = &ports[i];
            if (p->fd < 0)
                continue;
            if (!p->up) {
                idle = !ports_async;
                continue;
            }
            pfd[n++] = (struct pollfd){
                .fd = p->fd,
                .events = (p->to_conn_len ? 0 : POLLIN) | (p->to_port_len ? POLLOUT : 0),
            };
            pfd[n++] = (struct pollfd){
                .fd = p->conn,
                .events = (p->to_port_len ? 0 : POLLIN) | (p->to_conn_len ? POLLOUT : 0),
            };
        }
        int r = poll(pfd, (nfds_t)n, idle ? IDLE_RECHECK_MS : uevent_fd < 0 ? PORT_RESCAN_MS : -1);
        if (r < 0 && errno != EINTR)
            die("poll", errno);
        /* Ports added or named since (before the loop below looks at them). */
        if (pfd[1].revents || (uevent_fd < 0 && uptime_s() - last_scan >= PORT_RESCAN_MS / 1000.0)) {
            drain_uevents();
            scan_ports();
            last_scan = uptime_s();
        }
        if (pfd[0].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0)
                ;
        }
        int status;
        pid_t dead;
        while ((dead = waitpid(-1, &status, WNOHANG)) > 0) {
            if (dead == server) {
                /* Without the loop nothing is served: start it again. */
                server = fork();
                if (server == 0) {
                    sigprocmask(SIG_UNBLOCK, &chld, NULL);
                    serve_chronus(root, listen_socket(), shell_memfd);
                }
            }
        }
        /* Ports whose host came or went. */
        for (int i = 0; i < nports; i++) {
            struct port *p = &ports[i];
            if (p->fd < 0)
                continue;
            struct pollfd q = { .fd = p->fd, .events = POLLIN };
            (void)poll(&q, 1, 0);
            int host = !(q.revents & POLLHUP);
            if (p->up && !host) {
                port_down(p);
            } else if (!p->up && host) {
                p->conn = connect_agent();
                p->up = p->conn >= 0;
            }
        }
        int k = 2;
        for (int i = 0; i < nports; i++) {
            struct port *p = &ports[i];
            if (p->fd < 0 || !p->up)
                continue;
            struct pollfd *pp = &pfd[k], *pc = &pfd[k + 1];
            /* Only entries polled this round (a port that just came up was not). */
            int polled = k < n && pp->fd == p->fd && pc->fd == p->conn;
            k += polled ? 2 : 0;
            if (!polled)
                continue;
            int fail = 0;
            if (pp->revents & POLLIN && !p->to_conn_len) {
                ssize_t m = read(p->fd, p->to_conn, RELAY_BUF);
                if (m > 0)
                    p->to_conn_len = (size_t)m;
            }
            if (pc->revents & (POLLIN | POLLHUP | POLLERR) && !p->to_port_len) {
                ssize_t m = read(p->conn, p->to_port, RELAY_BUF);
                if (m > 0)
                    p->to_port_len = (size_t)m;
                else if (m == 0 || (errno != EAGAIN && errno != EINTR))
                    fail = 1; /* the loop closed it (protocol error): the host must reconnect */
            }
            if (flush(p->conn, p->to_conn, &p->to_conn_off, &p->to_conn_len) < 0)
                fail = 1;
            if (flush(p->fd, p->to_port, &p->to_port_off, &p->to_port_len) < 0)
                p->to_port_len = p->to_port_off = 0; /* host gone: noticed next round */
            if (fail) {
                close(p->conn);
                p->conn = connect_agent();
                p->to_conn_len = p->to_conn_off = p->to_port_len = p->to_port_off = 0;
                p->up = p->conn >= 0;
            }
        }
    }
}
