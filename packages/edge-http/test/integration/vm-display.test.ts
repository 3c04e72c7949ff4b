/**
 * The full-VM backend end to end (issue 15): an apiserver over a served
 * edge with the `vm` backend boots the Debian image (Xorg with one xterm),
 * a command typed into the xterm through `POST /input` both paints the
 * screen (checked in `GET /screenshot` by pixels, no OCR) and writes a file
 * read back through the agent (`GET /files`).
 *
 * The sandbox runs in its spec's image (busybox here), not in the VM's
 * Debian: commands and the xterm's shell see the image's root, on a
 * writable disk of the disk limit, under the pids limit. Pause saves the
 * machine and ends QEMU; resume brings back the screen and /tmp.
 *
 * Boot to the xterm under TCG measured here: 45 s to X on a quiet machine
 * (34 s to the agent), about 2 min with other tests running. It runs when
 * the image is there (`ensureVmImage`, in /var/cache/dsec/vm or
 * DSEC_VM_IMAGE_DIR; scripts/test.sh builds it) unless DSEC_TEST_VM=0. The file read through the agent once hung in one CI
 * run of three: the agent had opened only the virtio-serial ports the
 * driver had named when it first looked, so the first dedicated port (the
 * file read) was never served (guest_agent.c now keeps looking).
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { chmod, mkdtemp, readdir, readFile, rm, rmdir, stat } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { inflateSync } from 'node:zlib';
import { after, test } from 'node:test';
import { SandboxIdCodec } from '@dsec/core';
import { buildApiServer } from '@dsec/apiserver';
import { DEFAULT_VM_IMAGE_DIR, findQemu, findVmImage, openContainerEdge } from '@dsec/edge';
import { newEdgeSecret, RemoteEdge, serveEdge } from '@dsec/edge-http';
import { openControlDb } from '@dsec/iam';
import { PowerOfKPlacer } from '@dsec/placement';
import { Watcher } from '@dsec/watcher';
import { buildLayer, DirImageStore, makeBusyboxRootfs } from '@dsec/images';

const imageDir = process.env.DSEC_VM_IMAGE_DIR || DEFAULT_VM_IMAGE_DIR;
const available = Boolean(findQemu() && findVmImage(imageDir));
const enabled = process.env.DSEC_TEST_VM !== '0';

/** RGB pixels of a PNG as QEMU's screendump writes it (8-bit RGB, not interlaced). */
export function decodePng(png: Buffer): { width: number; height: number; rgb: Buffer } {
  assert.equal(png.toString('latin1', 1, 4), 'PNG');
  let at = 8;
  let width = 0;
  let height = 0;
  const idat: Buffer[] = [];
  while (at < png.length) {
    const len = png.readUInt32BE(at);
    const type = png.toString('latin1', at + 4, at + 8);
    const data = png.subarray(at + 8, at + 8 + len);
    if (type === 'IHDR') {
      width = data.readUInt32BE(0);
      height = data.readUInt32BE(4);
      assert.equal(data[8], 8, 'bit depth 8');
      assert.equal(data[9], 2, 'colour type RGB');
      assert.equal(data[12], 0, 'not interlaced');
    } else if (type === 'IDAT') idat.push(data);
    at += 12 + len;
  }
  const raw = inflateSync(Buffer.concat(idat));
  const stride = width * 3;
  const rgb = Buffer.alloc(stride * height);
  for (let y = 0; y < height; y++) {
    const filter = raw[y * (stride + 1)]!;
    const line = raw.subarray(y * (stride + 1) + 1, (y + 1) * (stride + 1));
    for (let x = 0; x < stride; x++) {
      const a = x >= 3 ? rgb[y * stride + x - 3]! : 0;
      const b = y > 0 ? rgb[(y - 1) * stride + x]! : 0;
      const c = x >= 3 && y > 0 ? rgb[(y - 1) * stride + x - 3]! : 0;
      const p = a + b - c;
      const pa = Math.abs(p - a);
      const pb = Math.abs(p - b);
      const pc = Math.abs(p - c);
      const paeth = pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
      const pred = [0, a, b, (a + b) >> 1, paeth][filter]!;
      rgb[y * stride + x] = (line[x]! + pred) & 0xff;
    }
  }
  return { width, height, rgb };
}

/** Share of the pixels in a rectangle that have exactly this colour. */
function share(
  img: { width: number; rgb: Buffer },
  rect: { x: number; y: number; w: number; h: number },
  [r, g, b]: [number, number, number],
): number {
  let hit = 0;
  for (let y = rect.y; y < rect.y + rect.h; y++) {
    for (let x = rect.x; x < rect.x + rect.w; x++) {
      const o = (y * img.width + x) * 3;
      if (img.rgb[o] === r && img.rgb[o + 1] === g && img.rgb[o + 2] === b) hit++;
    }
  }
  return hit / (rect.w * rect.h);
}

test(
  'a VM boots to an xterm; typed input paints the screen and writes a file the agent reads',
  {
    skip: !enabled ? 'DSEC_TEST_VM=0' : !available ? 'no QEMU or VM image' : false,
    timeout: 1_200_000,
  },
  async () => {
    const dir = await mkdtemp(join(tmpdir(), 'dsec-vm-it-'));
    await chmod(dir, 0o711);
    const cgroupParent = `dsec-test-${basename(dir)}`;
    const store = new DirImageStore(join(dir, 'images'));
    const rootfs = join(dir, 'busybox-rootfs');
    await makeBusyboxRootfs(rootfs);
    await buildLayer(store, { name: 'busybox', kind: 'base', from: { dir: rootfs } });
    await rm(rootfs, { recursive: true, force: true });
    const edge = await openContainerEdge({
      edgeId: 'node-vm',
      stateDir: join(dir, 'edge'),
      store,
      cgroupParent,
      fncall: false,
      vm: { imageDir },
    });
    const secret = newEdgeSecret();
    const server = await serveEdge({ edge, secret });
    const remote = new RemoteEdge({ edgeId: edge.edgeId, url: server.url, secret });
    const edges = new Map([[remote.edgeId, remote]]);
    const db = await openControlDb(':memory:');
    const boot = await db.iam.bootstrap();
    const watcher = new Watcher({ edges });
    await watcher.refresh();
    const app = buildApiServer({
      iam: db.iam,
      edges,
      watcher,
      placer: new PowerOfKPlacer({ view: () => watcher.view() }),
      ids: new SandboxIdCodec(randomBytes(32)),
    });
    const url = await app.listen({ port: 0, host: '127.0.0.1' });
    after(async () => {
      await app.close();
      remote.close();
      await server.close();
      for (const s of await edge.listSandboxes({}))
        await edge.stopSandbox(s.id).catch(() => undefined);
      await edge.close();
      // Whatever failed above, no QEMU of this test outlives it.
      for (const e of await readdir('/proc')) {
        const cmd = await readFile(`/proc/${e}/cmdline`, 'utf8').catch(() => '');
        if (cmd.includes('qemu-system') && cmd.includes(dir)) process.kill(Number(e), 'SIGKILL');
      }
      await rm(dir, { recursive: true, force: true });
      for (const ctrl of await readdir('/sys/fs/cgroup'))
        await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
    });
    const api = async (method: string, path: string, body?: unknown) => {
      const res = await fetch(`${url}${path}`, {
        method,
        headers: {
          authorization: `Bearer ${boot.key}`,
          ...(body !== undefined ? { 'content-type': 'application/json' } : {}),
        },
        body: body !== undefined ? JSON.stringify(body) : undefined,
      });
      const bytes = Buffer.from(await res.arrayBuffer());
      if (!res.ok) throw new Error(`${method} ${path}: ${res.status} ${bytes.toString()}`);
      return { res, bytes };
    };

    assert.ok((await edge.status()).backends.includes('vm'), 'the edge offers vm');
    const base = await stat(join(imageDir, 'disk.img'));
    const t0 = performance.now();
    const created = await api('POST', '/v1/sandboxes', {
      backend: 'vm',
      image: 'busybox',
      memoryLimitMb: 768,
      cpuCoresLimit: 1,
      diskLimitMb: 64,
      pidsLimit: 64,
    });
    const id = (JSON.parse(created.bytes.toString()) as { id: string }).id;
    const agentMs = performance.now() - t0;
    // The display comes up after the agent: wait for the xterm's shell.
    let xtermMs = 0;
    for (;;) {
      const { bytes } = await api('POST', `/v1/sandboxes/${id}/commands`, {
        shell: 'test -S /tmp/.X11-unix/X0 && cat /proc/[0-9]*/comm | grep -qx xterm',
      });
      if ((JSON.parse(bytes.toString()) as { exitCode: number }).exitCode === 0) break;
      assert.ok(performance.now() - t0 < 900_000, 'the xterm came up');
      await sleep(2_000);
    }
    xtermMs = performance.now() - t0;
    // Let the shell print its prompt.
    await sleep(5_000);
    console.log(
      `vm boot under TCG: agent ${Math.round(agentMs)} ms, xterm ${Math.round(xtermMs)} ms`,
    );

    // The hypervisor is jailed as the microVM's: its own uid, seccomp, the sandbox's cgroup.
    let qemuPid: string | undefined;
    for (const e of await readdir('/proc')) {
      const cmd = await readFile(`/proc/${e}/cmdline`, 'utf8').catch(() => '');
      if (cmd.includes('qemu-system') && cmd.includes(dir)) qemuPid = e;
    }
    assert.ok(qemuPid, 'the sandbox has a QEMU process');
    const status = await readFile(`/proc/${qemuPid}/status`, 'utf8');
    assert.ok(Number(/^Uid:\s+(\d+)/m.exec(status)?.[1]) >= 100_000, 'QEMU runs as its own uid');
    assert.match(status, /^Seccomp:\s+2$/m, 'QEMU runs under a seccomp filter');
    assert.match(
      await readFile(`/proc/${qemuPid}/cgroup`, 'utf8'),
      new RegExp(`/${cgroupParent}/`),
    );

    const before = decodePng((await api('GET', `/v1/sandboxes/${id}/screenshot`)).bytes);
    assert.deepEqual([before.width, before.height], [1280, 800]);
    // Bottom right of the xterm: black background, no text, before the command.
    const region = { x: 700, y: 400, w: 500, h: 350 };
    assert.ok(share(before, region, [0, 0, 0]) > 0.99, 'the xterm starts black');
    assert.ok(share(before, region, [255, 0, 255]) < 0.01);

    const marker = `DSEC-${randomBytes(4).toString('hex')}`;
    // The pointer over the xterm (no window manager: focus follows it), then the command.
    await api('POST', `/v1/sandboxes/${id}/input`, {
      events: [{ type: 'move', x: 640, y: 400 }],
    });
    await api('POST', `/v1/sandboxes/${id}/input`, {
      text: `printf '\\033]11;#ff00ff\\007'; echo ${marker} > /tmp/out\n`,
    });

    let painted = 0;
    for (let i = 0; i < 60 && painted < 0.95; i++) {
      await sleep(1_000);
      painted = share(
        decodePng((await api('GET', `/v1/sandboxes/${id}/screenshot`)).bytes),
        region,
        [255, 0, 255],
      );
    }
    assert.ok(painted >= 0.95, `the xterm turned magenta (${painted})`);
    const readOut = async () =>
      (await api('GET', `/v1/sandboxes/${id}/files?path=${encodeURIComponent('/tmp/out')}`)).bytes;
    const t1 = performance.now();
    assert.equal((await readOut()).toString(), `${marker}\n`);
    console.log(`file read through the agent: ${Math.round(performance.now() - t1)} ms`);

    const sh = async (shell: string) =>
      JSON.parse(
        (await api('POST', `/v1/sandboxes/${id}/commands`, { shell })).bytes.toString(),
      ) as {
        exitCode: number;
        stdout: string;
        stderr: string;
      };
    // The spec's image is the root (busybox's, not the VM's Debian with X) ...
    const root = await sh(
      'ls /bin/busybox; test -e /usr/lib/xorg && echo debian; cat /proc/self/cgroup',
    );
    assert.equal(root.stdout, '/bin/busybox\n0::/sandbox\n', root.stderr);
    // ... under the pids limit (the guest cgroup's, read through a cgroup2 mount of the guest) ...
    const pids = await sh(
      'mkdir -p /mnt/cg && mount -t cgroup2 none /mnt/cg && cat /mnt/cg/sandbox/pids.max; umount /mnt/cg',
    );
    assert.equal(pids.stdout, '64\n', pids.stderr);
    // ... on a writable disk of the disk limit.
    const disk = await sh(
      'dd if=/dev/zero of=/big bs=1M count=100 2>/dev/null; echo $?; du -m /big | cut -f1; rm /big',
    );
    const [ddExit, bigMb] = disk.stdout.trim().split('\n').map(Number);
    assert.notEqual(ddExit, 0, 'writing past the disk limit fails');
    assert.ok(bigMb! > 0 && bigMb! <= 64, `at most the disk limit was written (${bigMb} MiB)`);

    // Pause saves the machine and ends QEMU; resume brings back its memory (/tmp is a tmpfs) and screen.
    const tp = performance.now();
    await api('POST', `/v1/sandboxes/${id}/pause`);
    const pauseMs = performance.now() - tp;
    for (const e of await readdir('/proc')) {
      const cmd = await readFile(`/proc/${e}/cmdline`, 'utf8').catch(() => '');
      assert.ok(!(cmd.includes('qemu-system') && cmd.includes(dir)), 'no QEMU while paused');
    }
    const tr = performance.now();
    await api('POST', `/v1/sandboxes/${id}/resume`);
    const resumeMs = performance.now() - tr;
    console.log(`vm pause ${Math.round(pauseMs)} ms, resume ${Math.round(resumeMs)} ms`);
    assert.equal((await readOut()).toString(), `${marker}\n`);
    const resumed = decodePng((await api('GET', `/v1/sandboxes/${id}/screenshot`)).bytes);
    assert.ok(share(resumed, region, [255, 0, 255]) >= 0.95, 'the screen is back as it was');

    // A container sandbox has no display.
    const container = await api('POST', '/v1/sandboxes', { image: 'busybox' });
    const cid = (JSON.parse(container.bytes.toString()) as { id: string }).id;
    const res = await fetch(`${url}/v1/sandboxes/${cid}/screenshot`, {
      headers: { authorization: `Bearer ${boot.key}` },
    });
    assert.equal(res.status, 503);
    assert.equal(((await res.json()) as { error: { code: string } }).error.code, 'unavailable');

    await api('DELETE', `/v1/sandboxes/${id}`);
    const baseAfter = await stat(join(imageDir, 'disk.img'));
    assert.equal(baseAfter.mtimeMs, base.mtimeMs, 'the shared base image was not written');
    for (const e of await readdir('/proc')) {
      const cmd = await readFile(`/proc/${e}/cmdline`, 'utf8').catch(() => '');
      assert.ok(!(cmd.includes('qemu-system') && cmd.includes(dir)), 'QEMU ended with the sandbox');
    }
  },
);
