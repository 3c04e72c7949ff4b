#!/bin/sh
# Builds what a microVM sandbox boots (idempotent; setup and `dsec bench microvm`
# run it through ensureMicrovmAssets; an edge offers `microvm` only once it ran):
#   OUT/vmlinuz         Debian's linux-image-cloud-amd64 kernel, fetched with
#                       `apt-get download` and unpacked here, never installed
#   OUT/initramfs.cpio  busybox-static, the guest agent (chronus's event loop,
#                       statically linked) and the few modules the cloud kernel
#                       does not build in (virtio transport, blk, console, erofs, overlay;
#                       virtio_net apart, in modules.net, loaded only for a networked VM)
#   OUT/kernel/         the unpacked package (its modules; kept for rebuilds)
#   OUT/VERSION         the kernel release and the agent's source hash
#   OUT/FEATURES        what this initramfs's agent supports beyond the first
#                       version (`hotplug-ports`: it opens ports the host plugs
#                       after boot, so the edge may boot with one)
# Usage: build-assets.sh OUT NATIVE_SRC_DIR
set -eu
SELF=$(readlink -f "$0")
SRC=$(cd "$2" && pwd)
mkdir -p "$1"
cd "$1"

if [ ! -s vmlinuz ] || [ ! -d kernel/lib/modules ]; then
  PKG=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
  [ -n "$PKG" ] || { echo "build-assets: no linux-image-cloud-amd64 in apt's lists (apt-get update?)" >&2; exit 1; }
  rm -rf debs kernel && mkdir -p debs
  (cd debs && apt-get download "$PKG" >/dev/null 2>&1) || { echo "build-assets: apt-get download $PKG failed" >&2; exit 1; }
  dpkg-deb -x debs/*.deb kernel
  cp kernel/boot/vmlinuz-* vmlinuz.tmp && mv vmlinuz.tmp vmlinuz
  rm -rf debs
fi
KREL=$(ls kernel/lib/modules | head -1)
MODDIR=kernel/lib/modules/$KREL/kernel

AGENT_SRCS="guest_agent.c chronus_loop.c chronus_net.c reaper.c reclaim.c util.c"
HASH=$( (cd "$SRC" && cat $AGENT_SRCS chronus.h cmds.h util.h; cat "$SELF") | sha256sum | cut -c1-16)
if [ -s initramfs.cpio ] && [ "$(cat VERSION 2>/dev/null)" = "$KREL $HASH" ]; then exit 0; fi

rm -rf root && mkdir -p root/bin root/modules root/proc root/sys root/dev root/run root/newroot root/rw root/layers
${CC:-cc} -O2 -static -std=gnu11 -D_GNU_SOURCE -Wall -Wextra -Werror -I"$SRC" \
  -o root/dsec-agent $(for f in $AGENT_SRCS; do echo "$SRC/$f"; done)
strip root/dsec-agent
cp /bin/busybox root/bin/busybox
ln -s busybox root/bin/sh

# Modules in load order: each one's dependencies (modinfo) before it.
: > root/modules.order
: > root/modules.net
: > root/modules.late
ORDER=modules.order
# Drops a module's appended signature (struct module_signature, 12 bytes with
# the signature's length big-endian at its end, then a 28-byte marker). The
# guest kernel then loads it without an RSA check, which costs a lot under
# TCG and adds nothing here: the modules come from the apt-verified package
# into the initramfs we build. (The guest logs "tainting kernel"; it does not
# enforce signatures: CONFIG_MODULE_SIG_FORCE is off in Debian's kernels.)
unsign() {
  size=$(stat -c %s "$1")
  [ "$(tail -c 28 "$1")" = "~Module signature appended~" ] || return 0
  siglen=$(tail -c 32 "$1" | head -c 4 | od -An -tu1 | awk '{print $1*16777216+$2*65536+$3*256+$4}')
  head -c $((size - 28 - 12 - siglen)) "$1" > "$1.tmp" && mv "$1.tmp" "$1"
}
# `depends=` of the module's .modinfo section (kmod's modinfo may be absent).
modinfo_depends() {
  case $1 in *.xz) xz -dc "$1" ;; *) cat "$1" ;; esac | tr '\0' '\n' | sed -n 's/^depends=//p' | tr ',' ' '
}
add() {
  local f d
  f=$(find "$MODDIR" -name "$1.ko" -o -name "$1.ko.xz" | head -1)
  [ -n "$f" ] || { echo "build-assets: module $1 not in $KREL" >&2; exit 1; }
  for d in $(modinfo_depends "$f"); do add "$d"; done
  grep -qx "$1.ko" root/modules.order root/modules.net root/modules.late && return 0
  case $f in *.xz) xz -dc "$f" > "root/modules/$1.ko" ;; *) cp "$f" "root/modules/$1.ko" ;; esac
  unsign "root/modules/$1.ko"
  echo "$1.ko" >> "root/$ORDER"
}
for m in virtio virtio_ring virtio_mmio virtio_blk virtio_console erofs overlay; do
  if grep -q "CONFIG_$(echo $m | tr a-z A-Z)=y" kernel/boot/config-*; then continue; fi
  add "$m"
done
# The network driver, loaded by the agent only for a VM the edge gave a tap
# (`dsec.net=`): a VM without a network boots without it (ADR 0016).
ORDER=modules.net
for m in virtio_net; do
  if grep -q "CONFIG_$(echo $m | tr a-z A-Z)=y" kernel/boot/config-*; then continue; fi
  add "$m"
done
# Loaded by a child of the agent once it serves (nothing before the first
# command needs them): the balloon, for free-page reporting.
ORDER=modules.late
for m in virtio_balloon; do
  if grep -q "CONFIG_$(echo $m | tr a-z A-Z)=y" kernel/boot/config-*; then continue; fi
  add "$m"
done

cat > root/init <<'INIT'
#!/bin/sh
# Sandboxes boot with rdinit=/dsec-agent (the agent mounts the root itself,
# guest_agent.c). This script is the floor `dsec bench microvm` compares
# with (dsec.bare=1: print a marker from a shell, power off), and otherwise
# hands over to the agent.
export PATH=/bin
busybox mount -t proc proc /proc
if busybox grep -qw dsec.bare=1 /proc/cmdline; then
  echo DSEC-BARE-READY # stdout is the kernel's console, the serial port
  busybox poweroff -f
fi
busybox umount /proc
exec /dsec-agent
INIT
chmod 755 root/init
(cd root && find . | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0) > initramfs.cpio.tmp
mv initramfs.cpio.tmp initramfs.cpio
echo "hotplug-ports" > FEATURES
echo "$KREL $HASH" > VERSION
rm -rf root
