import assert from 'node:assert/strict';
import { chmod, mkdtemp } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { after, before, test } from 'node:test';
import { DirImageStore } from '@dsec/images';
import { openContainerEdge, prepareFnCallImages, type Edge } from '@dsec/edge';
import { runCode, type RunCodeResponse } from '@dsec/apiserver';
import { removeStateDir } from './fncall-fixture.js';

// SandboxFusion's compiled and node languages on a real edge: go, java, rust,
// nodejs, typescript (their toolkits from Debian's packages: a few hundred MB
// of downloads the first time, kept in the image store between runs).
const IMAGES_DIR = process.env['DSEC_TEST_FNCALL_IMAGES'] ?? '/var/tmp/dsec-fncall-it';

let edge: Edge;
let stateDir: string;
let cgroupParent: string;

before(async () => {
  const store = new DirImageStore(join(IMAGES_DIR, 'images'));
  await prepareFnCallImages(store, {
    cacheDir: join(IMAGES_DIR, 'cache'),
    images: ['fncall-node', 'fncall-sf-go', 'fncall-sf-java', 'fncall-sf-rust', 'fncall-sf-node'],
  });
  stateDir = await mkdtemp(join(tmpdir(), 'dsec-sf-lang-it-'));
  await chmod(stateDir, 0o711);
  cgroupParent = `dsec-test-${basename(stateDir)}`;
  edge = await openContainerEdge({
    edgeId: 'sf-edge',
    stateDir: join(stateDir, 'edge'),
    store,
    cgroupParent,
    fncall: { sizing: { min: 0, max: 1, spare: 0 } },
  });
});

after(async () => {
  await edge?.close();
  await removeStateDir(stateDir, cgroupParent);
});

const run = (body: Record<string, unknown>): Promise<RunCodeResponse> =>
  runCode(
    { run: (_p, req, signal) => edge.fncall(req, { projectId: 'p1', signal }) },
    { keyId: 'k1', projectId: 'p1', role: 'member' },
    { compile_timeout: 120, run_timeout: 30, ...body },
  );

const cases: { language: string; code: string; compiled: boolean }[] = [
  {
    language: 'go',
    compiled: true,
    code: 'package main\nimport "fmt"\nfunc main() { var a, b int; fmt.Scan(&a, &b); fmt.Println(a + b) }\n',
  },
  {
    language: 'java',
    compiled: true,
    code: 'import java.util.Scanner;\npublic class Main { public static void main(String[] x) { Scanner s = new Scanner(System.in); System.out.println(s.nextInt() + s.nextInt()); } }\n',
  },
  {
    language: 'rust',
    compiled: true,
    code: 'use std::io::Read;\nfn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s).unwrap(); let n: i64 = s.split_whitespace().map(|x| x.parse::<i64>().unwrap()).sum(); println!("{}", n); }\n',
  },
  {
    language: 'nodejs',
    compiled: false,
    code: "const s = require('fs').readFileSync(0, 'utf8'); console.log(s.trim().split(' ').map(Number).reduce((a, b) => a + b));\n",
  },
  {
    language: 'typescript',
    compiled: false,
    code: "const s: string = require('fs').readFileSync(0, 'utf8');\nconst n: number = s.trim().split(' ').map(Number).reduce((a: number, b: number) => a + b);\nconsole.log(n);\n",
  },
];

for (const c of cases) {
  test(`${c.language}: runs stdin to stdout${c.compiled ? ', compiled inside the call' : ''}`, async () => {
    const r = await run({ language: c.language, code: c.code, stdin: '40 2\n' });
    assert.equal(r.status, 'Success', JSON.stringify(r));
    assert.equal(r.run_result?.stdout, '42\n');
    if (c.compiled) assert.equal(r.compile_result?.return_code, 0);
    else assert.equal(r.compile_result, null);
  });
}

test("go and rust compile errors are Failed with the compiler's words", async () => {
  for (const language of ['go', 'rust']) {
    const r = await run({ language, code: 'this is not a program' });
    assert.equal(r.status, 'Failed', JSON.stringify(r));
    assert.notEqual(r.compile_result?.return_code, 0);
    assert.ok((r.compile_result?.stderr ?? '').length > 0);
    assert.equal(r.run_result, null);
  }
});
