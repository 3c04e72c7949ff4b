#!/bin/sh
# Builds the disk image a full-VM sandbox (`backend: 'vm'`) boots, from Debian's
# packages only (idempotent; an edge offers `vm` only once it ran):
#   OUT/disk.img     raw ext4 root filesystem (no partition table: root=/dev/vda),
#                    the read-only base every sandbox's qcow2 overlay points at
#   OUT/vmlinuz      the image's own kernel (linux-image-amd64) and initramfs
#   OUT/initrd.img   (initramfs-tools), copied out of its /boot: QEMU boots them
#                    directly (-kernel/-initrd), so the image has no bootloader
#   OUT/VERSION      the kernel release, the hash of this script and the agent, and
#                    `spec-root` (the image mounts the sandbox's own image: older
#                    images, which served their own root, are not offered)
# The system: debootstrap minbase, systemd and udev, Xorg (modesetting on QEMU's
# std VGA through bochs-drm, input through libinput), one full-screen xterm
# started by xinit without a window manager, and the DSec guest agent
# (packages/native/src/guest_agent.c, statically linked) as a systemd service
# serving the chronus protocol on the virtio-serial ports named dsec.N, in the
# sandbox's own image: dsec-root.service mounts the spec's EROFS layers (read-
# only disks, serial dsec-lN) under an overlay whose upper is the writable disk
# (serial dsec-rw) at /run/dsec/root, and the agent and the xterm's shell run
# chroot'ed there (docs/vm.md); the VM's Debian only provides kernel, X and agent.
# linux-image-amd64, not the cloud kernel: the cloud flavour has no DRM driver
# for an emulated display. No recommends; documentation, locales, kernel
# modules no VM here can use (sound, hardware drivers, network but virtio-net) and Mesa's
# DRI drivers with LLVM (Xorg runs unaccelerated: no glamor) are never
# unpacked (dpkg path-exclude).
# Usage: build-image.sh OUT NATIVE_SRC_DIR [MIRROR]
set -eu
SELF=$(readlink -f "$0")
SRC=$(cd "$2" && pwd)
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
MIRROR=${3:-http://deb.debian.org/debian}
SUITE=bookworm
PACKAGES="linux-image-amd64 initramfs-tools xserver-xorg-core xserver-xorg-input-libinput xinit xterm xfonts-base"
# The agent's sources as the microVM build compiles them (the list grows with the agent).
AGENT_SRCS=$(sed -n 's/^AGENT_SRCS="\(.*\)"$/\1/p' "$(dirname "$SELF")/../microvm/build-assets.sh")
[ -n "$AGENT_SRCS" ] || { echo "build-image: no AGENT_SRCS in microvm/build-assets.sh" >&2; exit 1; }
HASH=$( (cd "$SRC" && cat $AGENT_SRCS chronus.h util.h; cat "$SELF"; echo "$PACKAGES") | sha256sum | cut -c1-16)
if [ -s "$OUT/disk.img" ] && [ -s "$OUT/vmlinuz" ] && [ "$(cut -d' ' -f2 "$OUT/VERSION" 2>/dev/null)" = "$HASH" ]; then
  exit 0
fi

ROOT=$OUT/root
cleanup() {
  for m in dev/pts dev proc sys; do
    if grep -q " $ROOT/$m " /proc/mounts; then umount -l "$ROOT/$m" || true; fi
  done
}
trap cleanup EXIT INT TERM
cleanup
rm -rf "$ROOT" "$OUT/disk.img.tmp"
mkdir -p "$ROOT/etc/dpkg/dpkg.cfg.d"
cat > "$ROOT/etc/dpkg/dpkg.cfg.d/01-dsec-small" <<'CFG'
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
path-exclude=/lib/modules/*/kernel/sound/*
path-exclude=/lib/modules/*/kernel/net/*
path-exclude=/lib/modules/*/kernel/drivers/*
path-include=/lib/modules/*/kernel/drivers/virtio/*
path-include=/lib/modules/*/kernel/drivers/block/*
path-include=/lib/modules/*/kernel/drivers/char/*
path-include=/lib/modules/*/kernel/drivers/input/*
path-include=/lib/modules/*/kernel/drivers/video/*
path-include=/lib/modules/*/kernel/drivers/i2c/*
path-include=/lib/modules/*/kernel/drivers/gpu/drm/*
path-include=/lib/modules/*/kernel/drivers/net/virtio_net.ko
path-include=/lib/modules/*/kernel/drivers/net/net_failover.ko
path-include=/lib/modules/*/kernel/net/core/failover.ko
path-exclude=/lib/modules/*/kernel/drivers/gpu/drm/amd/*
path-exclude=/lib/modules/*/kernel/drivers/gpu/drm/nouveau/*
path-exclude=/lib/modules/*/kernel/drivers/gpu/drm/radeon/*
path-exclude=/lib/modules/*/kernel/drivers/gpu/drm/i915/*
path-exclude=/lib/firmware/*
path-exclude=/usr/lib/x86_64-linux-gnu/dri/*
path-exclude=/usr/lib/x86_64-linux-gnu/libLLVM-*
CFG

debootstrap --variant=minbase --include=systemd-sysv,udev,kmod "$SUITE" "$ROOT" "$MIRROR" >"$OUT/build.log" 2>&1 ||
  { tail -20 "$OUT/build.log" >&2; exit 1; }
mount -t proc proc "$ROOT/proc"
mount -t sysfs sysfs "$ROOT/sys"
mount --bind /dev "$ROOT/dev"
mount --bind /dev/pts "$ROOT/dev/pts"
printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' > "$ROOT/etc/apt/apt.conf.d/01-dsec"
# Only the drivers a q35 guest needs go into the initramfs.
mkdir -p "$ROOT/etc/initramfs-tools/conf.d"
echo 'MODULES=list' > "$ROOT/etc/initramfs-tools/conf.d/dsec"
printf 'virtio_pci\nvirtio_blk\next4\n' > "$ROOT/etc/initramfs-tools/modules"
chroot "$ROOT" /usr/bin/env DEBIAN_FRONTEND=noninteractive PATH=/usr/sbin:/usr/bin:/sbin:/bin \
  sh -c "apt-get update -q && apt-get install -y -q $PACKAGES" >>"$OUT/build.log" 2>&1 ||
  { tail -20 "$OUT/build.log" >&2; exit 1; }
chroot "$ROOT" apt-get clean
cleanup

# The guest agent, statically linked (the image's libc is not the build host's).
mkdir -p "$ROOT/usr/lib/dsec"
${CC:-cc} -O2 -static -std=gnu11 -D_GNU_SOURCE -Wall -Wextra -Werror -I"$SRC" \
  -o "$ROOT/usr/lib/dsec/dsec-guest-agent" $(for f in $AGENT_SRCS; do echo "$SRC/$f"; done)
strip "$ROOT/usr/lib/dsec/dsec-guest-agent"
# The platform's shell for `shell: true` commands (files, ports), as in a microVM.
cp /bin/busybox "$ROOT/usr/lib/dsec/busybox"

# Mesa's DRI drivers are left out: modesetting without glamor (a shadow framebuffer).
mkdir -p "$ROOT/etc/X11/xorg.conf.d"
cat > "$ROOT/etc/X11/xorg.conf.d/10-dsec.conf" <<'XCONF'
Section "Device"
  Identifier "vga"
  Driver "modesetting"
  Option "AccelMethod" "none"
EndSection
Section "ServerFlags"
  Option "BlankTime" "0"
  Option "StandbyTime" "0"
  Option "SuspendTime" "0"
  Option "OffTime" "0"
EndSection
XCONF
# The sandbox's root (docs/vm.md "The sandbox's image"), from the kernel command line
# the backend writes: dsec.layers=N (disks dsec-l0…, top layer first), the writable
# disk dsec-rw, dsec.pids=LIMIT, dsec.net=eth0,ADDR/PLEN,GW[,ADDR6/PLEN,GW6] and
# dsec.dns=RESOLVER (only addresses the edge derived). Without dsec.layers the
# VM's own root serves (an image built before the backend mounted images).
cat > "$ROOT/usr/lib/dsec/sandbox-root" <<'SH'
#!/bin/sh
set -eu
R=/run/dsec/root
B=/usr/lib/dsec/busybox
arg() { tr ' ' '\n' </proc/cmdline | sed -n "s/^$1=//p" | tail -1; }
# The virtio disk with this serial (by sysfs: udev may not have linked it yet).
disk() {
  for _ in $(seq 1 1000); do
    for b in /sys/block/vd*; do
      if [ "$(cat "$b/serial" 2>/dev/null)" = "$1" ]; then echo "/dev/${b##*/}"; return 0; fi
    done
    sleep 0.02
  done
  echo "dsec-root: no disk $1" >&2
  return 1
}
mountpoint -q "$R" && exit 0
n=$(arg dsec.layers)
[ -n "$n" ] || exit 0
modprobe -a erofs overlay
lower=
i=0
while [ "$i" -lt "$n" ]; do
  mkdir -p "/run/dsec/layers/$i"
  mount -t erofs -o ro "$(disk "dsec-l$i")" "/run/dsec/layers/$i"
  lower="${lower:+$lower:}/run/dsec/layers/$i"
  i=$((i + 1))
done
mkdir -p /run/dsec/rw "$R"
mount -t ext4 -o noatime "$(disk dsec-rw)" /run/dsec/rw
mkdir -p /run/dsec/rw/upper /run/dsec/rw/work
mount -t overlay overlay -o "lowerdir=$lower,upperdir=/run/dsec/rw/upper,workdir=/run/dsec/rw/work" "$R"
# The kernel filesystems inside it, as a microVM's (guest_agent.c setup_root).
mkdir -p "$R/proc" "$R/sys" "$R/dev" "$R/tmp"
mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
mount -t sysfs -o nosuid,nodev,noexec sys "$R/sys"
mount -t devtmpfs -o nosuid dev "$R/dev"
mkdir -p "$R/dev/pts" "$R/dev/shm"
mount -t devpts -o nosuid,noexec,newinstance,ptmxmode=0666,mode=0620,gid=5 devpts "$R/dev/pts"
rm -f "$R/dev/ptmx"
ln -s pts/ptmx "$R/dev/ptmx"
mount -t tmpfs -o nosuid,nodev,mode=1777 shm "$R/dev/shm"
mount -t tmpfs -o nosuid,nodev,mode=1777 tmp "$R/tmp"
# X programs of the image reach the VM's X server through its socket directory.
mkdir -p /tmp/.X11-unix "$R/tmp/.X11-unix"
chmod 1777 /tmp/.X11-unix "$R/tmp/.X11-unix"
mount --bind /tmp/.X11-unix "$R/tmp/.X11-unix"
# A cgroup the agent's command loop joins (guest_agent.c SANDBOX_CGROUP), and the
# xterm's shell too, so that whatever the sandbox runs counts: its pids limit, and
# the VM's memory less what its Debian, X and the agent need (DEBIAN_RESERVE_MB), so
# that the guest's OOM killer picks among the sandbox's processes, never the agent
# (a restarted agent loses the edge's commands in flight) or the display.
DEBIAN_RESERVE_MB=160
mkdir -p /sys/fs/cgroup/sandbox
for c in pids memory; do
  grep -qw $c /sys/fs/cgroup/cgroup.subtree_control || echo +$c >/sys/fs/cgroup/cgroup.subtree_control
done
total_kb=$(sed -n 's/^MemTotal: *\([0-9]*\) kB$/\1/p' /proc/meminfo)
echo $(((total_kb / 1024 - DEBIAN_RESERVE_MB) * 1048576)) >/sys/fs/cgroup/sandbox/memory.max
echo 0 >/sys/fs/cgroup/sandbox/memory.swap.max 2>/dev/null || true # (no file without swap accounting)
p=$(arg dsec.pids)
if [ -n "$p" ] && [ "$p" -gt 0 ]; then echo "$p" >/sys/fs/cgroup/sandbox/pids.max; fi
# The network (ADR 0016), when the edge gave the VM a tap: nothing here is a boundary
# (the guest's root may change all of it); the host's firewall on the tap is.
net=$(arg dsec.net)
if [ -n "$net" ]; then
  modprobe virtio_net
  IFS=, read -r dev a1 g1 a2 g2 <<EOF
$net
EOF
  for _ in $(seq 1 500); do [ -e "/sys/class/net/$dev" ] && break; sleep 0.02; done
  $B ip link set lo up
  $B ip link set "$dev" up
  $B ip addr add "$a1" dev "$dev"
  $B ip route add default via "$g1" dev "$dev"
  if [ -n "${a2:-}" ]; then
    $B ip -6 addr add "$a2" dev "$dev"
    $B ip -6 route add default via "$g2" dev "$dev"
  fi
  dns=$(arg dsec.dns)
  if [ -n "$dns" ]; then
    printf 'nameserver %s\noptions timeout:2 attempts:2\n' "$dns" >/run/dsec/resolv.conf
    mkdir -p "$R/etc"
    # A symlink (systemd-resolved images) would lead the bind elsewhere: replace it.
    if [ -L "$R/etc/resolv.conf" ] || ! [ -f "$R/etc/resolv.conf" ]; then rm -rf "$R/etc/resolv.conf"; fi
    touch "$R/etc/resolv.conf"
    mount --bind /run/dsec/resolv.conf "$R/etc/resolv.conf"
    mount -o remount,bind,ro "$R/etc/resolv.conf"
  fi
fi
SH
# The agent serves the sandbox's root once mounted (else the VM's own). virtio_console
# is loaded here rather than waited for from udev; its ports still appear one by one
# (the agent keeps looking for more, guest_agent.c open_ports).
cat > "$ROOT/usr/lib/dsec/start-agent" <<'SH'
#!/bin/sh
modprobe virtio_console || true
R=/
if mountpoint -q /run/dsec/root; then R=/run/dsec/root; fi
exec /usr/lib/dsec/dsec-guest-agent "$R" /usr/lib/dsec/busybox
SH
# The xterm's shell is the sandbox's own: in its image's root, under its pids limit.
cat > "$ROOT/usr/lib/dsec/terminal-shell" <<'SH'
#!/bin/sh
if [ -d /sys/fs/cgroup/sandbox ]; then echo $$ >/sys/fs/cgroup/sandbox/cgroup.procs; fi
# (/bin/sh of the image may be a link that only resolves inside it.)
if mountpoint -q /run/dsec/root && /usr/sbin/chroot /run/dsec/root /bin/sh -c :; then
  cd /run/dsec/root && exec /usr/sbin/chroot . /bin/sh -c 'cd "$HOME" 2>/dev/null || cd /; exec /bin/sh -i'
fi
exec /bin/bash -i
SH
chmod 755 "$ROOT/usr/lib/dsec/sandbox-root" "$ROOT/usr/lib/dsec/start-agent" "$ROOT/usr/lib/dsec/terminal-shell"
cat > "$ROOT/etc/systemd/system/dsec-root.service" <<'UNIT'
[Unit]
Description=DSec sandbox root: the spec's image layers under an overlay on the writable disk
DefaultDependencies=no
After=systemd-udevd.service local-fs.target systemd-tmpfiles-setup.service
Before=dsec-agent.service dsec-display.service
# A sandbox without its root serves nothing: the VM powers off, and the edge
# reports the console's last lines (the script's errors go there too).
FailureAction=poweroff-force
[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/lib/dsec/sandbox-root
StandardError=journal+console
[Install]
WantedBy=sysinit.target
UNIT
cat > "$ROOT/etc/systemd/system/dsec-agent.service" <<'UNIT'
[Unit]
Description=DSec guest agent (chronus protocol on the virtio-serial ports dsec.N)
DefaultDependencies=no
After=systemd-udevd.service local-fs.target dsec-root.service
Requires=dsec-root.service
[Service]
ExecStart=/usr/lib/dsec/start-agent
# A guest without its ports (or a crash) is tried again.
Restart=always
RestartSec=200ms
StartLimitIntervalSec=0
[Install]
WantedBy=sysinit.target
UNIT
cat > "$ROOT/etc/systemd/system/dsec-display.service" <<'UNIT'
[Unit]
Description=DSec display: Xorg on the VM's VGA with one full-screen xterm, no window manager
After=systemd-udevd.service systemd-udev-trigger.service dsec-root.service
Requires=dsec-root.service
[Service]
Environment=HOME=/root
WorkingDirectory=/root
# No window manager: focus follows the pointer, and the xterm covers the screen
# (213x61 cells of xterm's 6x13 font: the 1280x800 mode the backend's VGA offers).
ExecStart=/usr/bin/xinit /usr/bin/xterm -geometry 213x61+0+0 -bg black -fg white -xrm 'XTerm*allowColorOps: true' -e /usr/lib/dsec/terminal-shell -- /usr/lib/xorg/Xorg :0 vt7 -nolisten tcp -noreset -s 0 -dpms
Restart=always
RestartSec=1
[Install]
WantedBy=multi-user.target
UNIT
ln -sf /etc/systemd/system/dsec-agent.service "$ROOT/etc/systemd/system/sysinit.target.wants/dsec-agent.service"
ln -sf /etc/systemd/system/dsec-root.service "$ROOT/etc/systemd/system/sysinit.target.wants/dsec-root.service"
mkdir -p "$ROOT/etc/systemd/system/multi-user.target.wants"
ln -sf /etc/systemd/system/dsec-display.service "$ROOT/etc/systemd/system/multi-user.target.wants/dsec-display.service"
# Nothing periodic, no logins: a sandbox is driven by the agent and the display only.
for u in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer e2scrub_reap.service fstrim.timer dpkg-db-backup.timer \
  systemd-tmpfiles-clean.timer getty@tty1.service serial-getty@ttyS0.service getty.target \
  systemd-timesyncd.service; do
  ln -sf /dev/null "$ROOT/etc/systemd/system/$u"
done
echo '/dev/vda / ext4 rw,noatime 0 0' > "$ROOT/etc/fstab"
echo dsec-vm > "$ROOT/etc/hostname"
rm -f "$ROOT/etc/machine-id" && touch "$ROOT/etc/machine-id"
rm -rf "$ROOT/var/lib/apt/lists"/* "$ROOT/var/cache/apt"/*.bin "$ROOT/var/log"/*.log

KREL=$(ls "$ROOT/usr/lib/modules" | head -1)
cp "$ROOT/boot/vmlinuz-$KREL" "$OUT/vmlinuz.tmp"
cp "$ROOT/boot/initrd.img-$KREL" "$OUT/initrd.img.tmp"
# The root's size plus a quarter (and 256 MiB) free for the sandbox's writes;
# the overlay is sparse, so a sandbox pays only for what it writes.
USED_KB=$(du -sk "$ROOT" | cut -f1)
SIZE_MB=$((USED_KB * 5 / 4 / 1024 + 256))
truncate -s "${SIZE_MB}M" "$OUT/disk.img.tmp"
mkfs.ext4 -q -F -d "$ROOT" -L dsec-root -O '^has_journal' -m 0 "$OUT/disk.img.tmp" >>"$OUT/build.log" 2>&1
mv "$OUT/disk.img.tmp" "$OUT/disk.img"
mv "$OUT/vmlinuz.tmp" "$OUT/vmlinuz"
mv "$OUT/initrd.img.tmp" "$OUT/initrd.img"
echo "$KREL $HASH spec-root" > "$OUT/VERSION"
rm -rf "$ROOT"
