#!/bin/sh
# Builds the disk image a full-VM sandbox (`backend: 'vm'`) boots, from Debian's
# packages only (idempotent; an edge offers `vm` only once it ran):
#   OUT/disk.img     raw ext4 root filesystem (no partition table: root=/dev/vda),
#                    the read-only base every sandbox's qcow2 overlay points at
#   OUT/vmlinuz      the image's own kernel (linux-image-amd64) and initramfs
#   OUT/initrd.img   (initramfs-tools), copied out of its /boot: QEMU boots them
#                    directly (-kernel/-initrd), so the image has no bootloader
#   OUT/VERSION      the kernel release and the hash of this script and the agent
# The system: debootstrap minbase, systemd and udev, Xorg (modesetting on QEMU's
# std VGA through bochs-drm, input through libinput), one full-screen xterm
# started by xinit without a window manager, and the DSec guest agent
# (packages/native/src/guest_agent.c, statically linked) as a systemd service
# serving the chronus protocol on the virtio-serial ports named dsec.N.
# linux-image-amd64, not the cloud kernel: the cloud flavour has no DRM driver
# for an emulated display. No recommends; documentation, locales, kernel
# modules no VM here can use (sound, network, hardware drivers) and Mesa's
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
cat > "$ROOT/etc/systemd/system/dsec-agent.service" <<'UNIT'
[Unit]
Description=DSec guest agent (chronus protocol on the virtio-serial ports dsec.N)
DefaultDependencies=no
After=systemd-udevd.service local-fs.target
[Service]
ExecStart=/usr/lib/dsec/dsec-guest-agent / /usr/lib/dsec/busybox
# Until udev loaded virtio_console the agent finds no port and exits: try again.
Restart=always
RestartSec=200ms
StartLimitIntervalSec=0
[Install]
WantedBy=sysinit.target
UNIT
cat > "$ROOT/etc/systemd/system/dsec-display.service" <<'UNIT'
[Unit]
Description=DSec display: Xorg on the VM's VGA with one full-screen xterm, no window manager
After=systemd-udevd.service systemd-udev-trigger.service
[Service]
Environment=HOME=/root
WorkingDirectory=/root
# No window manager: focus follows the pointer, and the xterm covers the screen
# (213x61 cells of xterm's 6x13 font: the 1280x800 mode the backend's VGA offers).
ExecStart=/usr/bin/xinit /usr/bin/xterm -geometry 213x61+0+0 -bg black -fg white -xrm 'XTerm*allowColorOps: true' -- /usr/lib/xorg/Xorg :0 vt7 -nolisten tcp -noreset -s 0 -dpms
Restart=always
RestartSec=1
[Install]
WantedBy=multi-user.target
UNIT
ln -sf /etc/systemd/system/dsec-agent.service "$ROOT/etc/systemd/system/sysinit.target.wants/dsec-agent.service"
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
echo "$KREL $HASH" > "$OUT/VERSION"
rm -rf "$ROOT"
