/*
 * Mount subcommands: EROFS layers (file-backed, or through auto-clearing
 * loop devices on kernels before 6.12), FUSE mounts served by a caller's
 * /dev/fuse descriptor, unmounting, and the overlay root filesystem of a
 * sandbox (optionally over idmapped lower layers).
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/loop.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cmds.h"
#include "util.h"

/*
 * Binds `path` to a free loop device that detaches itself once nothing holds
 * it open any more (LO_FLAGS_AUTOCLEAR): when the mount made on it goes, so
 * does the device, and a failed mount leaves nothing behind either (closing
 * the returned fd is then the last release). Writes "/dev/loopN" to `dev`
 * and returns the device's fd; dies on failure.
 */
static int attach_loop(const char *path, int read_only, char dev[32])
{
    int file = open(path, (read_only ? O_RDONLY : O_RDWR) | O_CLOEXEC);
    if (file < 0)
        dief(errno, "open %s", path);
    int ctl = open("/dev/loop-control", O_RDWR | O_CLOEXEC);
    if (ctl < 0)
        dief(errno, "open /dev/loop-control");
    /*
     * Read-only (layer) devices ask for direct I/O on the backing file, so a
     * layer's pages are cached once (by the device) rather than twice; where
     * the backing filesystem refuses it, buffered I/O it is.
     */
    struct loop_config config = {
        .fd = (uint32_t)file,
        .info = { .lo_flags = LO_FLAGS_AUTOCLEAR |
                              (read_only ? LO_FLAGS_READ_ONLY | LO_FLAGS_DIRECT_IO : 0) },
    };
    int loop = -1;
    /* Another process may take the free device first: ask again. */
    for (int attempt = 0; attempt < 64 && loop < 0; attempt++) {
        int n = ioctl(ctl, LOOP_CTL_GET_FREE);
        if (n < 0)
            dief(errno, "LOOP_CTL_GET_FREE");
        snprintf(dev, 32, "/dev/loop%d", n);
        loop = open(dev, (read_only ? O_RDONLY : O_RDWR) | O_CLOEXEC);
        if (loop < 0)
            dief(errno, "open %s", dev);
        if (ioctl(loop, LOOP_CONFIGURE, &config) < 0) {
            int err = errno;
            close(loop);
            loop = -1;
            if (err == EINVAL && (config.info.lo_flags & LO_FLAGS_DIRECT_IO)) {
                config.info.lo_flags &= ~(uint32_t)LO_FLAGS_DIRECT_IO;
                continue;
            }
            if (err != EBUSY)
                dief(err, "LOOP_CONFIGURE %s", dev);
        }
    }
    if (loop < 0)
        dief(EBUSY, "no free loop device for %s", path);
    close(ctl);
    close(file); /* the loop device holds its own reference */
    return loop;
}

/* ---- mount-erofs IMAGE TARGET [--device BLOB] [--loop] ---- */

int cmd_mount_erofs(int argc, char **argv)
{
    const char *image = NULL, *target = NULL, *blob = NULL;
    int use_loop = 0;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--device") == 0 && i + 1 < argc)
            blob = argv[++i];
        else if (strcmp(argv[i], "--loop") == 0)
            use_loop = 1;
        else if (!image)
            image = argv[i];
        else if (!target)
            target = argv[i];
        else
            dief(EINVAL, "mount-erofs: unexpected argument %s", argv[i]);
    }
    if (!image || !target)
        dief(EINVAL, "usage: mount-erofs IMAGE TARGET [--device BLOB] [--loop]");

    /*
     * Without --loop, the raw syscall with a regular file as source makes the
     * kernel use the file directly (file-backed EROFS, Linux 6.12+); mount(8)
     * would set up a loop device. With --loop (older kernels), the image and
     * the blob each get a read-only, auto-clearing loop device: EROFS then
     * opens block devices only, the extra device included.
     */
    const char *image_file = image;
    char image_dev[32], blob_dev[32];
    int image_loop = -1, blob_loop = -1;
    if (use_loop) {
        image_loop = attach_loop(image, 1, image_dev);
        image = image_dev;
        if (blob) {
            blob_loop = attach_loop(blob, 1, blob_dev);
            blob = blob_dev;
        }
    }
    char data[PATH_MAX + 16];
    if (blob && (size_t)snprintf(data, sizeof data, "device=%s", blob) >= sizeof data)
        dief(ENAMETOOLONG, "mount-erofs: device path");
    int r = mount(image, target, "erofs", MS_RDONLY | MS_NODEV | MS_NOSUID, blob ? data : NULL);
    int err = errno;
    /* The mount holds the devices now; they clear themselves once it is gone. */
    if (blob_loop >= 0)
        close(blob_loop);
    if (image_loop >= 0)
        close(image_loop);
    if (r < 0)
        dief(err, "mount erofs %s%s%s on %s", image_file, use_loop ? " via " : "",
             use_loop ? image : "", target);
    return 0;
}

/* ---- mount-fuse TARGET --fd N [--name NAME] ---- */

/* Mounts a FUSE filesystem served on an already-open /dev/fuse descriptor
 * the caller passed down (fd N). The mount keeps its own reference to the
 * open file, so this helper just mounts and exits while the caller serves. */
int cmd_mount_fuse(int argc, char **argv)
{
    const char *target = NULL, *name = "dsec-blobd";
    uint64_t fd = UINT64_MAX;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--fd") == 0 && i + 1 < argc) {
            if (parse_u64(argv[++i], INT_MAX, &fd))
                dief(EINVAL, "mount-fuse: --fd %s", argv[i]);
        } else if (strcmp(argv[i], "--name") == 0 && i + 1 < argc)
            name = argv[++i];
        else if (!target)
            target = argv[i];
        else
            dief(EINVAL, "mount-fuse: unexpected argument %s", argv[i]);
    }
    if (!target || fd == UINT64_MAX)
        dief(EINVAL, "usage: mount-fuse TARGET --fd N [--name NAME]");
    if (name[0] == 0 || strpbrk(name, ", \t\n"))
        dief(EINVAL, "mount-fuse: --name %s", name);

    char type[128], data[256];
    if ((size_t)snprintf(type, sizeof type, "fuse.%s", name) >= sizeof type)
        dief(ENAMETOOLONG, "mount-fuse: --name");
    snprintf(data, sizeof data,
             "fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions,"
             "max_read=1048576",
             (int)fd);
    if (mount(name, target, type, MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, data) < 0)
        dief(errno, "mount %s on %s", type, target);
    return 0;
}

/* ---- umount [--detach] TARGET... ---- */

int cmd_umount(int argc, char **argv)
{
    int flags = UMOUNT_NOFOLLOW, status = 0;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--detach") == 0) {
            flags |= MNT_DETACH;
            continue;
        }
        /* Not mounted (EINVAL) or already gone (ENOENT) is the state we want. */
        if (umount2(argv[i], flags) < 0 && errno != EINVAL && errno != ENOENT) {
            char what[PATH_MAX + 16];
            snprintf(what, sizeof what, "umount %s", argv[i]);
            report_error(what, errno);
            status = 1;
        }
    }
    return status;
}

/* ---- mount-rootfs ---- */

struct rootfs_args {
    const char *target, *upper, *work;
    /* --upper-image IMG --upper-mount DIR (with --exec only): the writable layer
     * lives on its own filesystem image (a disk quota), mounted at DIR in the
     * private namespace; upper and work are in it. */
    const char *upper_image, *upper_mount;
    const char **lowers; /* top (highest priority) first */
    int nlowers;
    int idmap;
    uint32_t host_id, count;
    char **exec_argv; /* --exec: run this in the private mount namespace once mounted */
    /* --mask DIR (with --exec only): an empty tmpfs over DIR in the private
     * namespace, e.g. the cgroup2 mount of a hybrid host, which crun refuses
     * to run beside; what the runtime writes there vanishes with it. */
    const char **masks;
    int nmasks;
    /* --volume SRC DIR (with --exec and --idmap only): an idmapped clone of
     * the mount at SRC (a volume's host-side mount root) attached on DIR,
     * created here, for the runtime to bind into the sandbox. Kept: it is
     * in the private namespace and goes with it. */
    const char **volume_srcs, **volume_dirs;
    int nvolumes;
};

/* Everything mount-rootfs made so far, undone in reverse on failure. */
struct staging {
    char (*dirs)[PATH_MAX];
    int ndirs_made;   /* staging directories created */
    int nmounts_made; /* of those, how many carry an idmapped mount */
};

static void parse_idmap(const char *s, struct rootfs_args *a)
{
    uint64_t host, count;
    char buf[64];
    const char *colon = strchr(s, ':');
    if (!colon || (size_t)(colon - s) >= sizeof buf)
        dief(EINVAL, "--idmap %s: want HOSTID:COUNT", s);
    memcpy(buf, s, (size_t)(colon - s));
    buf[colon - s] = 0;
    if (parse_u64(buf, UINT32_MAX, &host) || parse_u64(colon + 1, UINT32_MAX, &count) || count == 0)
        dief(EINVAL, "--idmap %s: want HOSTID:COUNT", s);
    a->idmap = 1;
    a->host_id = (uint32_t)host;
    a->count = (uint32_t)count;
}

static void parse_rootfs_args(int argc, char **argv, struct rootfs_args *a)
{
    a->lowers = calloc((size_t)argc + 1, sizeof *a->lowers);
    a->masks = calloc((size_t)argc + 1, sizeof *a->masks);
    a->volume_srcs = calloc((size_t)argc + 1, sizeof *a->volume_srcs);
    a->volume_dirs = calloc((size_t)argc + 1, sizeof *a->volume_dirs);
    if (!a->lowers || !a->masks || !a->volume_srcs || !a->volume_dirs)
        die("calloc", ENOMEM);
    for (int i = 0; i < argc; i++) {
        const char *opt = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(opt, "--exec") == 0) {
            if (!val)
                dief(EINVAL, "mount-rootfs: --exec needs a command");
            a->exec_argv = argv + i + 1;
            break;
        }
        if (!val)
            dief(EINVAL, "mount-rootfs: %s needs a value", opt);
        if (strcmp(opt, "--volume") == 0) {
            if (i + 2 >= argc)
                dief(EINVAL, "mount-rootfs: --volume needs SRC and DIR");
            a->volume_srcs[a->nvolumes] = argv[i + 1];
            a->volume_dirs[a->nvolumes++] = argv[i + 2];
            i += 2;
            continue;
        }
        i++;
        if (strcmp(opt, "--target") == 0)
            a->target = val;
        else if (strcmp(opt, "--upper") == 0)
            a->upper = val;
        else if (strcmp(opt, "--work") == 0)
            a->work = val;
        else if (strcmp(opt, "--upper-image") == 0)
            a->upper_image = val;
        else if (strcmp(opt, "--upper-mount") == 0)
            a->upper_mount = val;
        else if (strcmp(opt, "--lower") == 0)
            a->lowers[a->nlowers++] = val;
        else if (strcmp(opt, "--idmap") == 0)
            parse_idmap(val, a);
        else if (strcmp(opt, "--mask") == 0)
            a->masks[a->nmasks++] = val;
        else
            dief(EINVAL, "mount-rootfs: unknown option %s", opt);
    }
    if (!a->target || !a->upper || !a->work || a->nlowers == 0 ||
        !a->upper_image != !a->upper_mount || ((a->upper_image || a->nmasks) && !a->exec_argv) ||
        (a->nvolumes && (!a->exec_argv || !a->idmap)))
        dief(EINVAL, "usage: mount-rootfs --target T --upper U --work W [--idmap H:N] "
                     "[--upper-image IMG --upper-mount DIR] [--mask DIR]... [--volume SRC DIR]... --lower L... [--exec CMD ARG...]");
}

/* Overlay options separate layers with ':' and options with ','. */
static void check_option_safe(const char *path)
{
    if (strpbrk(path, ":,\\"))
        dief(EINVAL, "overlay path %s contains ':', ',' or '\\'", path);
}

static int write_file(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    int r = write_all(fd, text, strlen(text));
    close(fd);
    return r;
}

/*
 * Returns an fd of a fresh user namespace mapping uids and gids 0..count-1
 * to host_id.. (only used as an idmap; no process stays in it), or -errno.
 * A child unshares and waits; we write its maps, open its namespace and kill it.
 */
static int make_idmap_userns(uint32_t host_id, uint32_t count)
{
    int sync[2];
    if (pipe2(sync, O_CLOEXEC) < 0)
        return -errno;
    pid_t pid = fork();
    if (pid < 0) {
        int err = errno;
        close(sync[0]);
        close(sync[1]);
        return -err;
    }
    if (pid == 0) {
        int err = unshare(CLONE_NEWUSER) < 0 ? errno : 0;
        (void)!write(sync[1], &err, sizeof err);
        for (;;)
            pause();
    }
    close(sync[1]);
    int err = 0, fd = -1;
    if (read(sync[0], &err, sizeof err) != sizeof err)
        err = err ? err : ECHILD;
    close(sync[0]);
    if (!err) {
        char path[64], map[64];
        snprintf(map, sizeof map, "0 %u %u\n", host_id, count);
        snprintf(path, sizeof path, "/proc/%d/uid_map", pid);
        int r = write_file(path, map);
        snprintf(path, sizeof path, "/proc/%d/gid_map", pid);
        if (!r)
            r = write_file(path, map);
        snprintf(path, sizeof path, "/proc/%d/ns/user", pid);
        if (!r && (fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
            r = -errno;
        err = -r;
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return err ? -err : fd;
}

/*
 * Mounts the ext4 image `image` on `dir` through a loop device that detaches
 * itself when the mount goes (LO_FLAGS_AUTOCLEAR): with --exec the mount is
 * in the sandbox's private namespace, so it, and the loop device, go with the
 * sandbox. Then makes the overlay's upper and work directories in it, owned
 * by the sandbox's root. Dies on failure.
 */
static void mount_upper_image(const struct rootfs_args *a)
{
    char dev[32];
    int loop = attach_loop(a->upper_image, 0, dev);
    int r = mount(dev, a->upper_mount, "ext4", MS_NOSUID | MS_NODEV, NULL);
    int err = errno;
    close(loop); /* the mount holds the device now; autoclear once it is gone */
    if (r < 0)
        dief(err, "mount %s (%s) on %s", a->upper_image, dev, a->upper_mount);
    uid_t owner = a->idmap ? a->host_id : 0;
    for (const char *d = a->upper;; d = a->work) {
        if ((mkdir(d, 0755) < 0 && errno != EEXIST) || chown(d, owner, owner) < 0) {
            err = errno;
            umount2(a->upper_mount, MNT_DETACH);
            dief(err, "prepare %s", d);
        }
        if (d == a->work)
            break;
    }
}

/* Attaches an idmapped clone of `lower` on the (existing) directory `dir`. */
static int mount_idmapped(const char *lower, const char *dir, int userns_fd, const char **step)
{
    *step = "open_tree";
    int tree = open_tree(AT_FDCWD, lower, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    if (tree < 0)
        return -errno;
    struct mount_attr attr = { .attr_set = MOUNT_ATTR_IDMAP, .userns_fd = (uint64_t)userns_fd };
    int r = 0;
    *step = "mount_setattr(MOUNT_ATTR_IDMAP)";
    if (mount_setattr(tree, "", AT_EMPTY_PATH, &attr, sizeof attr) < 0)
        r = -errno;
    *step = "move_mount";
    if (!r && move_mount(tree, "", AT_FDCWD, dir, MOVE_MOUNT_F_EMPTY_PATH) < 0)
        r = -errno;
    close(tree); /* an unattached clone disappears with its last fd */
    return r;
}

static void undo_staging(struct staging *s)
{
    for (int i = s->ndirs_made - 1; i >= 0; i--) {
        if (i < s->nmounts_made)
            umount2(s->dirs[i], MNT_DETACH | UMOUNT_NOFOLLOW);
        rmdir(s->dirs[i]);
    }
    s->ndirs_made = s->nmounts_made = 0;
}

/* Creates T.l<N> for each lower and attaches an idmapped clone there; dies on failure (after undo). */
static void stage_idmapped_lowers(const struct rootfs_args *a, struct staging *s)
{
    int userns = make_idmap_userns(a->host_id, a->count);
    if (userns < 0)
        dief(-userns, "create user namespace for idmap %u:%u", a->host_id, a->count);
    for (int i = 0; i < a->nlowers; i++) {
        char *dir = s->dirs[i];
        if ((size_t)snprintf(dir, PATH_MAX, "%s.l%d", a->target, i) >= PATH_MAX) {
            undo_staging(s);
            dief(ENAMETOOLONG, "staging dir for %s", a->target);
        }
        if (mkdir(dir, 0700) < 0) {
            int err = errno;
            undo_staging(s);
            dief(err, "mkdir %s", dir);
        }
        s->ndirs_made++;
        const char *step;
        int r = mount_idmapped(a->lowers[i], dir, userns, &step);
        if (r < 0) {
            undo_staging(s);
            dief(-r, "%s %s", step, a->lowers[i]);
        }
        s->nmounts_made++;
    }
    close(userns);
}

/*
 * Attaches an idmapped, nosuid, nodev clone of each volume's mount on its
 * staging directory (made here, 0700). The clone is of the mount at SRC
 * alone (no submounts), taken by the platform's own path to the volume's
 * mount root: nothing inside the volume is resolved. Disk ids 0..count-1
 * appear as the sandbox's host range, so a file one sandbox wrote as its
 * root is root's in the next sandbox too, whatever range that one has.
 * Dies on failure (the private namespace, and the clones, go with us).
 */
static void stage_volumes(const struct rootfs_args *a)
{
    int userns = make_idmap_userns(a->host_id, a->count);
    if (userns < 0)
        dief(-userns, "create user namespace for idmap %u:%u", a->host_id, a->count);
    for (int i = 0; i < a->nvolumes; i++) {
        const char *src = a->volume_srcs[i], *dir = a->volume_dirs[i];
        if (mkdir(dir, 0700) < 0 && errno != EEXIST)
            dief(errno, "mkdir %s", dir);
        int tree = open_tree(AT_FDCWD, src, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_SYMLINK_NOFOLLOW);
        if (tree < 0)
            dief(errno, "open_tree %s", src);
        struct mount_attr attr = {
            .attr_set = MOUNT_ATTR_IDMAP | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
            .userns_fd = (uint64_t)userns,
        };
        if (mount_setattr(tree, "", AT_EMPTY_PATH, &attr, sizeof attr) < 0)
            dief(errno, "mount_setattr(MOUNT_ATTR_IDMAP) %s", src);
        if (move_mount(tree, "", AT_FDCWD, dir, MOVE_MOUNT_F_EMPTY_PATH) < 0)
            dief(errno, "move_mount %s to %s", src, dir);
        close(tree);
    }
    close(userns);
}

int cmd_mount_rootfs(int argc, char **argv)
{
    struct rootfs_args a = { 0 };
    parse_rootfs_args(argc, argv, &a);
    check_option_safe(a.target);
    check_option_safe(a.upper);
    check_option_safe(a.work);
    for (int i = 0; i < a.nlowers; i++)
        check_option_safe(a.lowers[i]);

    /*
     * With --exec, the rootfs is mounted in a private mount namespace that
     * only CMD (the OCI runtime) and what it starts can see: when the sandbox
     * ends, the namespace goes and the overlay with it. No unmount is left to
     * do on the host, even after a crash, and the host's mount table does not
     * grow with the number of sandboxes.
     */
    if (a.exec_argv) {
        if (unshare(CLONE_NEWNS) < 0)
            die("unshare(CLONE_NEWNS)", errno);
        if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
            die("make / private", errno);
        for (int i = 0; i < a.nmasks; i++) {
            if (mount("dsec-mask", a.masks[i], "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=0755") < 0)
                dief(errno, "mask %s", a.masks[i]);
        }
    }

    if (a.upper_image)
        mount_upper_image(&a);

    struct staging s = { .dirs = calloc((size_t)a.nlowers, PATH_MAX) };
    if (!s.dirs)
        die("calloc", ENOMEM);
    if (a.idmap)
        stage_idmapped_lowers(&a, &s);

    /* Kernel mount data is limited to one page. */
    char data[4096];
    size_t used = (size_t)snprintf(data, sizeof data, "lowerdir=");
    for (int i = 0; i < a.nlowers && used < sizeof data; i++)
        used += (size_t)snprintf(data + used, sizeof data - used, "%s%s", i ? ":" : "",
                                 a.idmap ? s.dirs[i] : a.lowers[i]);
    if (used < sizeof data)
        used += (size_t)snprintf(data + used, sizeof data - used, ",upperdir=%s,workdir=%s", a.upper, a.work);
    if (used >= sizeof data) {
        undo_staging(&s);
        dief(E2BIG, "overlay options for %s (more than one page)", a.target);
    }
    if (mount("overlay", a.target, "overlay", 0, data) < 0) {
        int err = errno;
        undo_staging(&s);
        dief(err, "mount overlay on %s", a.target);
    }

    /*
     * Overlayfs takes private clones of its layers when it is mounted
     * (clone_private_mount), and those clones keep the idmapping. So the
     * staging mounts can be detached and their directories removed right
     * away: the overlay keeps reading through the idmapped clones and copy-up
     * keeps working (checked by native.test.ts). Each sandbox then costs one
     * visible mount, and unmounting the rootfs is all the cleanup there is.
     */
    undo_staging(&s);
    if (a.nvolumes)
        stage_volumes(&a);
    if (a.exec_argv) {
        execvp(a.exec_argv[0], a.exec_argv);
        die(a.exec_argv[0], errno);
    }
    return 0;
}
