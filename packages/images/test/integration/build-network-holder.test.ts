import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';

// The build network's namespace holder does not outlive a build process
// killed outright (SIGKILL: no `finally`, no `close`). Needs root (unshare --net).

const CHILD = `
import { egressBuildNetwork } from '@dsec/images';
const manager = {
  setup: async () => ({ resolvConf: '', gateway4: '10.255.255.1' }),
  attach: async () => undefined,
  teardown: async () => undefined,
};
const h = await egressBuildNetwork(manager, { first: 0, count: 1 }).open({ allow: [] });
console.log(h.nsPath.split('/')[2]);
setInterval(() => undefined, 1000);
`;

test('a build process killed with SIGKILL leaves no network namespace holder behind', async () => {
  const child = spawn(
    process.execPath,
    ['--conditions=dsec-source', '--import', 'tsx', '--input-type=module', '-e', CHILD],
    { stdio: ['ignore', 'pipe', 'inherit'] },
  );
  let out = '';
  child.stdout.on('data', (d: Buffer) => (out += d.toString()));
  for (let i = 0; i < 600 && !out.includes('\n'); i++) await sleep(50);
  const pid = Number(out.trim());
  assert.ok(Number.isInteger(pid) && pid > 0, `no holder pid from the child: ${out}`);
  assert.ok(existsSync(`/proc/${pid}`));
  const exited = new Promise((r) => child.once('exit', r));
  child.kill('SIGKILL');
  await exited;
  for (let i = 0; i < 200 && existsSync(`/proc/${pid}`); i++) await sleep(10);
  const alive = existsSync(`/proc/${pid}`);
  if (alive) process.kill(pid, 'SIGKILL');
  assert.equal(alive, false, 'the holder outlived the build process');
});
