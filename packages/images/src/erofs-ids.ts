import { open, type FileHandle } from 'node:fs/promises';
import { DsecError, throwIfAborted } from '@dsec/core';
import type { TreeStats } from './walk.js';

/**
 * Rewrites the owners in an EROFS image in place, and counts its tree.
 *
 * Why: a sandbox's writable layer holds *host* ids (the sandbox's root is
 * host uid `hostId`, the overlay writes what the idmapped view shows), while
 * layers hold the ids the sandbox sees (root is 0), so any sandbox can stack
 * them under its own idmapping. erofs-utils 1.5 has no `--uid-offset`, and
 * shifting the source tree would touch the running sandbox (or need a copy),
 * so the ids are shifted in the built image: a walk of the directory tree
 * that patches each inode's `i_uid`/`i_gid` once. Ids outside the range
 * become 65534 (`nobody`), as the kernel shows unmapped ids.
 *
 * On-disk format (linux/fs/erofs/erofs_fs.h): superblock at 1024; inode `nid`
 * at `meta_blkaddr * blksz + nid * 32`; compact inodes are 32 bytes with
 * 16-bit ids, extended ones 64 bytes with 32-bit ids; directories are plain
 * or tail-inline blocks of 12-byte dirents. Xattrs follow the inode: a
 * 12-byte header (shared count at byte 4), 4-byte ids of shared entries (at
 * `xattr_blkaddr * blksz + id * 4`), then inline entries (name length, name
 * index, value size, name, value; 4-byte aligned). The superblock's crc32c
 * (which covers the rest of block 0, where the first inodes can sit) is
 * recomputed.
 */
export interface ShiftErofsIdsOptions {
  /** First host id of the range (the sandbox's root). */
  hostId: number;
  /** Size of the range: host ids `hostId … hostId + count - 1` become `0 … count - 1`. */
  count: number;
  /**
   * A layer made from a sandbox (SECURITY.md H36): strip what could give a
   * sandbox that stacks it a privilege the source could not use — device
   * nodes other than whiteouts become whiteouts (the path is absent), set-id
   * bits go from every non-directory, and file capabilities (the
   * `security.capability` xattr) are emptied: a valid record with no
   * capability in it. Sandboxes run with no_new_privs behind a deny-all
   * device cgroup, so the source could use none of them either.
   */
  sanitize?: boolean | undefined;
  signal?: AbortSignal | undefined;
}

/** What `shiftErofsIds` counted, and what `sanitize` took out. */
export interface ShiftErofsIdsResult extends TreeStats {
  neutralized: { devices: number; setId: number; capabilities: number };
}

const SUPER_OFFSET = 1024;
const EROFS_MAGIC = 0xe0f5e1e2;
const FEATURE_COMPAT_SB_CHKSUM = 0x1;
const OVERFLOW_ID = 65534;
const S_IFMT = 0o170000;
const S_IFDIR = 0o040000;
const S_IFREG = 0o100000;
const S_IFCHR = 0o020000;
const S_IFBLK = 0o060000;
const S_ISUID = 0o4000;
const S_ISGID = 0o2000;
/** `security.` is xattr name index 6 in EROFS; file capabilities are `security.capability`. */
const XATTR_INDEX_SECURITY = 6;
const XATTR_IBODY_HEADER = 12;
/** VFS_CAP_REVISION_MASK and the value sizes of revisions 1, 2 and 3 (linux/capability.h). */
const VFS_CAP_REVISION_MASK = 0xff000000;
const VFS_CAP_SIZES: Record<number, number> = { 0x01000000: 12, 0x02000000: 20, 0x03000000: 24 };
const LAYOUT_FLAT_PLAIN = 0;
const LAYOUT_FLAT_INLINE = 2;
const DIRENT_SIZE = 12;

export async function shiftErofsIds(
  image: string,
  options: ShiftErofsIdsOptions,
): Promise<ShiftErofsIdsResult> {
  const { hostId, count } = options;
  if (!Number.isSafeInteger(hostId) || hostId < 0 || !Number.isSafeInteger(count) || count < 1) {
    throw new DsecError('invalid_argument', 'hostId and count must be non-negative integers', {
      field: 'hostId',
    });
  }
  const shift = (id: number): number =>
    id >= hostId && id < hostId + count ? id - hostId : OVERFLOW_ID;
  const fh = await open(image, 'r+');
  try {
    const sb = await readAt(fh, SUPER_OFFSET, 128);
    if (sb.readUInt32LE(0) !== EROFS_MAGIC) {
      throw new DsecError('invalid_argument', `${image} is not an EROFS image`, { field: 'image' });
    }
    const blkszBits = sb.readUInt8(12);
    const blksz = 1 << blkszBits;
    const rootNid = sb.readUInt16LE(14);
    const metaBlkaddr = sb.readUInt32LE(40);
    const xattrBlkaddr = sb.readUInt32LE(44);
    const inodeAt = (nid: number): number => metaBlkaddr * blksz + nid * 32;
    const neutralized = { devices: 0, setId: 0, capabilities: 0 };
    const sharedDone = new Set<number>();
    /** Empties the file-capability record at `at` (its revision kept: a valid record, no capability). */
    const emptyCapability = async (at: number): Promise<boolean> => {
      const e = await readAt(fh, at, 4);
      const nameLen = e.readUInt8(0);
      const valueSize = e.readUInt16LE(2);
      if (e.readUInt8(1) !== XATTR_INDEX_SECURITY || nameLen !== 10) return false;
      const name = await readAt(fh, at + 4, nameLen);
      if (name.toString('latin1') !== 'capability') return false;
      const valueAt = at + 4 + nameLen;
      const value = await readAt(fh, valueAt, valueSize);
      const revision =
        value.length >= 4 ? (value.readUInt32LE(0) & VFS_CAP_REVISION_MASK) >>> 0 : 0;
      const empty = Buffer.alloc(valueSize);
      if (VFS_CAP_SIZES[revision] === valueSize) {
        empty.writeUInt32LE(revision, 0);
        // Revision 3 names the root it applies to: keep it (0 and unmapped ones alike grant nothing now).
        if (valueSize === 24) value.copy(empty, 20, 20, 24);
      }
      if (value.equals(empty)) return false;
      await fh.write(empty, 0, valueSize, valueAt);
      return true;
    };

    let fileCount = 0;
    let contentBytes = 0;
    const seen = new Set<number>();
    const stack = [rootNid];
    while (stack.length > 0) {
      throwIfAborted(options.signal);
      const nid = stack.pop()!;
      if (seen.has(nid)) continue; // a hard link: patched (and its bytes counted) once
      seen.add(nid);
      const pos = inodeAt(nid);
      const head = await readAt(fh, pos, 64);
      const format = head.readUInt16LE(0);
      const extended = (format & 1) === 1;
      const layout = (format >> 1) & 0x7;
      const xattrCount = head.readUInt16LE(2);
      let mode = head.readUInt16LE(4);
      const inodeSize = extended ? 64 : 32;
      const xattrSize = xattrCount === 0 ? 0 : XATTR_IBODY_HEADER + (xattrCount - 1) * 4;
      if (options.sanitize) {
        const type = mode & S_IFMT;
        let newMode = mode;
        if (
          (type === S_IFCHR || type === S_IFBLK) &&
          (type === S_IFBLK || head.readUInt32LE(16) !== 0)
        ) {
          // A device node: a whiteout instead (rdev 0:0), the path absent in the sandbox.
          newMode = S_IFCHR | (mode & 0o777);
          await fh.write(Buffer.alloc(4), 0, 4, pos + 16);
          neutralized.devices++;
        }
        if (type !== S_IFDIR && (mode & (S_ISUID | S_ISGID)) !== 0) {
          newMode &= ~(S_ISUID | S_ISGID);
          neutralized.setId++;
        }
        if (newMode !== mode) {
          const m = Buffer.alloc(2);
          m.writeUInt16LE(newMode, 0);
          await fh.write(m, 0, 2, pos + 4);
          mode = newMode;
        }
        if (xattrSize > 0) {
          const xattrs = await readAt(fh, pos + inodeSize, xattrSize);
          const shared = xattrs.readUInt8(4);
          for (let i = 0; i < shared; i++) {
            const id = xattrs.readUInt32LE(XATTR_IBODY_HEADER + i * 4);
            if (sharedDone.has(id)) continue;
            sharedDone.add(id);
            if (await emptyCapability(xattrBlkaddr * blksz + id * 4)) neutralized.capabilities++;
          }
          let at = XATTR_IBODY_HEADER + shared * 4;
          while (at + 4 <= xattrSize) {
            const len = 4 + xattrs.readUInt8(at) + xattrs.readUInt16LE(at + 2);
            if (await emptyCapability(pos + inodeSize + at)) neutralized.capabilities++;
            at += (len + 3) & ~3;
          }
        }
      }
      let size: number;
      if (extended) {
        size = Number(head.readBigUInt64LE(8));
        const ids = Buffer.alloc(8);
        ids.writeUInt32LE(shift(head.readUInt32LE(24)), 0);
        ids.writeUInt32LE(shift(head.readUInt32LE(28)), 4);
        await fh.write(ids, 0, 8, pos + 24);
      } else {
        size = head.readUInt32LE(8);
        const ids = Buffer.alloc(4);
        ids.writeUInt16LE(shift(head.readUInt16LE(24)), 0);
        ids.writeUInt16LE(shift(head.readUInt16LE(26)), 2);
        await fh.write(ids, 0, 4, pos + 24);
      }
      if ((mode & S_IFMT) === S_IFREG) contentBytes += size;
      if ((mode & S_IFMT) !== S_IFDIR) continue;

      // A directory: read its blocks (the tail may sit inline after the inode).
      if (layout !== LAYOUT_FLAT_PLAIN && layout !== LAYOUT_FLAT_INLINE) {
        throw new DsecError('internal', `EROFS directory ${nid} has data layout ${layout}`);
      }
      const rawBlkaddr = head.readUInt32LE(16);
      const blocks = Math.ceil(size / blksz);
      for (let b = 0; b < blocks; b++) {
        const len = Math.min(blksz, size - b * blksz);
        const inline = layout === LAYOUT_FLAT_INLINE && b === blocks - 1 && len < blksz;
        const at = inline ? pos + inodeSize + xattrSize : (rawBlkaddr + b) * blksz;
        const block = await readAt(fh, at, len);
        const n = block.readUInt16LE(8) / DIRENT_SIZE;
        for (let i = 0; i < n; i++) {
          const off = i * DIRENT_SIZE;
          const child = Number(block.readBigUInt64LE(off));
          const nameoff = block.readUInt16LE(off + 8);
          const end = i + 1 < n ? block.readUInt16LE(off + DIRENT_SIZE + 8) : len;
          // Names in the last dirent of a block may be NUL-padded.
          let name = block.subarray(nameoff, end);
          const nul = name.indexOf(0);
          if (nul >= 0) name = name.subarray(0, nul);
          const s = name.toString('latin1');
          if (s === '.' || s === '..') continue;
          fileCount++;
          stack.push(child);
        }
      }
    }

    const compat = sb.readUInt32LE(8);
    // The checksum covers the rest of block 0, where inodes and xattrs may sit: recompute it.
    if ((compat & FEATURE_COMPAT_SB_CHKSUM) !== 0) {
      const rest = await readAt(fh, SUPER_OFFSET, blksz - SUPER_OFFSET);
      rest.writeUInt32LE(0, 4);
      const sum = Buffer.alloc(4);
      sum.writeUInt32LE(crc32c(0xffffffff, rest), 0);
      await fh.write(sum, 0, 4, SUPER_OFFSET + 4);
    }
    await fh.sync();
    return { fileCount, contentBytes, neutralized };
  } finally {
    await fh.close();
  }
}

async function readAt(fh: FileHandle, position: number, length: number): Promise<Buffer> {
  const buf = Buffer.alloc(length);
  let got = 0;
  while (got < length) {
    const { bytesRead } = await fh.read(buf, got, length - got, position + got);
    if (bytesRead === 0) throw new DsecError('internal', 'EROFS image ends early');
    got += bytesRead;
  }
  return buf;
}

let table: Uint32Array | undefined;

/** CRC-32C (Castagnoli) as the kernel's `crc32c(seed, …)`: no final inversion. */
export function crc32c(seed: number, data: Buffer): number {
  if (!table) {
    table = new Uint32Array(256);
    for (let i = 0; i < 256; i++) {
      let c = i;
      for (let k = 0; k < 8; k++) c = c & 1 ? (c >>> 1) ^ 0x82f63b78 : c >>> 1;
      table[i] = c >>> 0;
    }
  }
  let crc = seed >>> 0;
  for (const byte of data) crc = (table[(crc ^ byte) & 0xff]! ^ (crc >>> 8)) >>> 0;
  return crc >>> 0;
}
