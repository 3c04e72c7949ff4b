import assert from 'node:assert/strict';
import { chmod, mkdtemp } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { isDsecError } from '@dsec/core';
import { DirImageStore } from '@dsec/images';
import { openContainerEdge, prepareFnCallImages, type Edge } from '@dsec/edge';
import { runCode, type RunCodeResponse } from '@dsec/apiserver';
import type { Principal } from '@dsec/iam';
import { removeStateDir } from './fncall-fixture.js';

// SandboxFusion's /run_code (docs/fncall.md) end to end on a real edge: the
// apiserver's mapping and driver, the sf-base and sf-gcc runtimes, their images.
const IMAGES_DIR = process.env['DSEC_TEST_FNCALL_IMAGES'] ?? '/var/tmp/dsec-fncall-it';

let edge: Edge;
let stateDir: string;
let cgroupParent: string;
const principal: Principal = { keyId: 'k1', projectId: 'p1', role: 'member' };

before(async () => {
  const store = new DirImageStore(join(IMAGES_DIR, 'images'));
  await prepareFnCallImages(store, {
    cacheDir: join(IMAGES_DIR, 'cache'),
    images: ['fncall-node', 'fncall-sf-gcc'],
  });
  stateDir = await mkdtemp(join(tmpdir(), 'dsec-sf-it-'));
  await chmod(stateDir, 0o711);
  cgroupParent = `dsec-test-${basename(stateDir)}`;
  edge = await openContainerEdge({
    edgeId: 'sf-edge',
    stateDir: join(stateDir, 'edge'),
    store,
    cgroupParent,
    fncall: { sizing: { min: 0, max: 2, spare: 0 } },
  });
});

after(async () => {
  await edge?.close();
  await removeStateDir(stateDir, cgroupParent);
});

const b64 = (s: string | Buffer) => Buffer.from(s).toString('base64');
const run = (body: Record<string, unknown>): Promise<RunCodeResponse> =>
  runCode(
    { run: (_p, req, signal) => edge.fncall(req, { projectId: 'p1', signal }) },
    principal,
    body,
  );

void describe('sandboxfusion: languages end to end', () => {
  test('python: stdin, files by base64, fetch_files, exit codes', async () => {
    const r = await run({
      language: 'python',
      code: [
        'import sys',
        "data = open('in/data.bin', 'rb').read()",
        "open('out.bin', 'wb').write(data[::-1])",
        'print(sum(map(int, input().split())), len(data))',
        "print('warn', file=sys.stderr)",
      ].join('\n'),
      stdin: '1 2\n',
      files: { 'in/data.bin': b64(Buffer.from([0, 1, 2, 255])) },
      fetch_files: ['out.bin', 'missing.txt'],
    });
    assert.equal(r.status, 'Success', JSON.stringify(r));
    assert.equal(r.compile_result, null);
    assert.equal(r.run_result?.status, 'Finished');
    assert.equal(r.run_result?.return_code, 0);
    assert.equal(r.run_result?.stdout, '3 4\n');
    assert.equal(r.run_result?.stderr, 'warn\n');
    assert.ok((r.run_result?.execution_time ?? -1) >= 0);
    assert.deepEqual(r.files, { 'out.bin': b64(Buffer.from([255, 2, 1, 0])) });

    const failed = await run({ language: 'python', code: 'import sys\nsys.exit(3)' });
    assert.equal(failed.status, 'Failed');
    assert.equal(failed.run_result?.return_code, 3);
    const raised = await run({ language: 'python', code: 'raise ValueError("boom")' });
    assert.equal(raised.status, 'Failed');
    assert.match(raised.run_result?.stderr ?? '', /ValueError: boom/);
  });

  test('python: run_timeout is TimeLimitExceeded (Failed), memory_limit_MB holds', async () => {
    const slow = await run({
      language: 'python',
      code: 'import time\ntime.sleep(30)',
      run_timeout: 1,
    });
    assert.equal(slow.status, 'Failed');
    assert.equal(slow.run_result?.status, 'TimeLimitExceeded');
    assert.equal(slow.run_result?.return_code, null);
    const big = await run({
      language: 'python',
      code: 'x = bytearray(400 * 1024 * 1024)\nprint("allocated")',
      memory_limit_MB: 128,
    });
    assert.equal(big.status, 'Failed', JSON.stringify(big));
    assert.match(big.run_result?.stderr ?? '', /MemoryError/);
    const fits = await run({
      language: 'python',
      code: 'x = bytearray(400 * 1024 * 1024)\nprint("allocated")',
      memory_limit_MB: 1024,
    });
    assert.equal(fits.run_result?.stdout, 'allocated\n', JSON.stringify(fits));
  });

  test('python with a binary file and nothing to fetch: the direct driver writes its bytes', async () => {
    const r = await run({
      language: 'python',
      code: "import sys\nd = open('blob', 'rb').read()\nprint(list(d), input())\nsys.exit(4)",
      stdin: 'in\n',
      files: { blob: b64(Buffer.from([0xff, 0xfe, 0])) },
    });
    assert.equal(r.status, 'Failed', JSON.stringify(r));
    assert.equal(r.run_result?.stdout, '[255, 254, 0] in\n');
    assert.equal(r.run_result?.return_code, 4);
    const slow = await run({
      language: 'python',
      code: 'import time\ntime.sleep(30)',
      files: { blob: b64(Buffer.from([0xff])) },
      run_timeout: 1,
    });
    assert.equal(slow.run_result?.status, 'TimeLimitExceeded');
  });

  test('bash', async () => {
    const r = await run({ language: 'bash', code: 'read a b; echo $((a*b)); ls', stdin: '6 7\n' });
    assert.equal(r.status, 'Success', JSON.stringify(r));
    assert.equal(r.run_result?.stdout, '42\nmain.sh\n');
  });

  test('c and cpp compile inside the call; a compile error is Failed with compile_result', async () => {
    const c = await run({
      language: 'c',
      code: '#include <stdio.h>\n#include <math.h>\nint main(){int a,b;scanf("%d %d",&a,&b);printf("%d %.1f\\n",a+b,sqrt(16.0));return 0;}',
      stdin: '2 3',
    });
    assert.equal(c.status, 'Success', JSON.stringify(c));
    assert.equal(c.compile_result?.status, 'Finished');
    assert.equal(c.compile_result?.return_code, 0);
    assert.equal(c.run_result?.stdout, '5 4.0\n');

    const cpp = await run({
      language: 'cpp',
      code: '#include <iostream>\n#include <vector>\nint main(){std::vector<int> v{1,2,3};long s=0;for(int x:v)s+=x;std::cout<<s<<std::endl;return 1;}',
    });
    assert.equal(cpp.status, 'Failed', JSON.stringify(cpp));
    assert.equal(cpp.compile_result?.return_code, 0);
    assert.equal(cpp.run_result?.stdout, '6\n');
    assert.equal(cpp.run_result?.return_code, 1);

    const broken = await run({ language: 'cpp', code: 'int main( { return 0; }' });
    assert.equal(broken.status, 'Failed');
    assert.notEqual(broken.compile_result?.return_code, 0);
    assert.match(broken.compile_result?.stderr ?? '', /error/);
    assert.equal(broken.run_result, null);

    // A compiler that hangs (an endless template expansion stands in) meets compile_timeout.
    const hang = await run({
      language: 'cpp',
      code: 'template<int N> struct F { static const int v = F<N+1>::v; };\nint main(){ return F<0>::v; }',
      compile_timeout: 0.2,
    });
    assert.ok(
      hang.compile_result?.status === 'TimeLimitExceeded' || hang.compile_result?.return_code !== 0,
      JSON.stringify(hang.compile_result),
    );
    assert.equal(hang.status, 'Failed');
  });
});

void describe('sandboxfusion: attacks', () => {
  test('fetch_files never follows a symlink the program made, nor reads a non-file', async () => {
    const r = await run({
      language: 'bash',
      code: 'ln -s /etc/passwd link; mkdir d; ln -s /etc dir; mkfifo fifo; echo ok > real',
      fetch_files: ['link', 'dir/passwd', 'd', 'fifo', 'real'],
    });
    assert.equal(r.status, 'Success', JSON.stringify(r));
    assert.deepEqual(r.files, { real: b64('ok\n') });
  });

  test('files and fetch_files with .. or absolute paths are refused before anything runs', async () => {
    for (const body of [
      { files: { '../x': b64('x') } },
      { files: { '/etc/x': b64('x') } },
      { files: { 'a/./b': b64('x') } },
      { fetch_files: ['../../etc/passwd'] },
      { fetch_files: ['/etc/passwd'] },
      { files: { x: 'not base64!' } },
    ]) {
      await assert.rejects(
        run({ language: 'python', code: 'print(1)', ...body }),
        (e) => isDsecError(e, 'invalid_argument'),
        JSON.stringify(body),
      );
    }
  });

  test('memory_limit_MB abuse and a language not served are invalid_argument', async () => {
    for (const m of [1e12, 5, 4097, 1.5]) {
      await assert.rejects(
        run({ language: 'python', code: 'print(1)', memory_limit_MB: m }),
        (e) => isDsecError(e, 'invalid_argument'),
        String(m),
      );
    }
    for (const language of ['cobol', 'julia', '__proto__', 'constructor'])
      await assert.rejects(
        run({ language, code: 'x' }),
        (e) => isDsecError(e, 'invalid_argument') && e.field === 'language',
      );
  });

  test('output past the stream cap ends as SandboxError, run directly or by the driver', async () => {
    const direct = await run({
      language: 'python',
      code: 'import sys\nsys.stdout.write("x" * (5 * 1024 * 1024))',
    });
    assert.equal(direct.status, 'SandboxError');
    assert.match(direct.message, /went past/);
    const driven = await run({
      language: 'bash',
      code: 'head -c 5000000 /dev/zero | tr "\\0" x; echo done > f',
      fetch_files: ['f'],
    });
    assert.equal(driven.status, 'SandboxError', JSON.stringify(driven).slice(0, 300));
    assert.equal(driven.run_result?.stdout?.length, 2 * 1024 * 1024);
  });
});
