import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { randomId } from '@dsec/core';
import { openContainerEdge, type Edge } from '@dsec/edge';
import { hostResources, makeStateDir, spec } from './fixture.js';

type State = Awaited<ReturnType<typeof makeStateDir>>;

/** Without sandbox networks: the supervisor does not depend on them, and the tests stay quick. */
function openEdge(state: State): Promise<Edge> {
  return openContainerEdge({
    edgeId: 'node-1',
    stateDir: join(state.dir, 'edge'),
    store: state.store,
    cgroupParent: state.cgroupParent,
    network: { mode: 'none' },
  });
}

/** The supervisor's pid as its pid file names it, if that process runs. */
async function supervisorPid(state: State): Promise<number | undefined> {
  const pid = Number(
    (
      await readFile(join(state.dir, 'edge', 'chronus', 'chronusd.pid'), 'utf8').catch(() => '')
    ).trim(),
  );
  return pid > 1 && (await running(pid)) ? pid : undefined;
}

async function running(pid: number): Promise<boolean> {
  const stat = await readFile(`/proc/${pid}/stat`, 'utf8').catch(() => '');
  return stat !== '' && !/\) [ZX] /.test(stat);
}

/** Pids of this state dir's command daemons (hostResources lists them as `PID dsec-chronus`). */
async function daemons(state: State): Promise<number[]> {
  return (await hostResources(state.dir)).processes
    .filter((p) => p.endsWith(' dsec-chronus'))
    .map((p) => Number(p.split(' ')[0]));
}

async function echo(edge: Edge, id: string, text: string): Promise<string> {
  return (await edge.runCommand(id, { shell: `echo ${text}` })).stdout;
}

/** Runs `fn` with an open edge; whatever happens, stops every sandbox, the edge and its supervisor. */
async function withState(
  fn: (state: State, edge: { current: Edge }) => Promise<void>,
): Promise<void> {
  const state = await makeStateDir();
  const edge = { current: await openEdge(state) };
  try {
    await fn(state, edge);
  } finally {
    const e = await edge.current.listSandboxes({}).then(
      () => edge.current,
      () => openEdge(state), // the test closed it
    );
    for (const sb of await e.listSandboxes({})) await e.stopSandbox(sb.id).catch(() => undefined);
    await e.close();
    await state.cleanup();
  }
}

test('an edge that crashed leaves its supervisor running; the next edge adopts it and stops it on close', async () => {
  await withState(async (state, edge) => {
    await edge.current.close(); // the child edge owns the state dir until it is killed
    const child = spawn(
      process.execPath,
      [
        '--conditions=dsec-source',
        '--import',
        'tsx',
        new URL('./chronus-crash-child.ts', import.meta.url).pathname,
        state.dir,
        state.cgroupParent,
      ],
      { stdio: ['ignore', 'pipe', 'inherit'] },
    );
    const id = await new Promise<string>((resolve, reject) => {
      let out = '';
      child.stdout.setEncoding('utf8').on('data', (s: string) => {
        out += s;
        if (out.endsWith('\n')) resolve(out.trim());
      });
      child.once('exit', (code) => reject(new Error(`child edge exited early (${code})`)));
    });
    const before = await supervisorPid(state);
    assert.ok(before !== undefined, 'the child edge started a supervisor');
    child.kill('SIGKILL');
    await new Promise((r) => child.once('exit', r));
    await sleep(100);
    assert.equal(await supervisorPid(state), before, 'the supervisor outlived the edge');

    edge.current = await openEdge(state);
    assert.equal(await echo(edge.current, id, 'adopted'), 'adopted\n');
    const second = await edge.current.createSandbox({
      id: randomId('sb'),
      projectId: 'p1',
      spec: spec(),
    });
    assert.equal(
      await supervisorPid(state),
      before,
      'the new sandbox came from the adopted supervisor',
    );
    assert.equal(await echo(edge.current, second.id, 'second'), 'second\n');

    await edge.current.close();
    assert.equal(await running(before), false, 'a closing edge stops its supervisor');
    assert.equal((await daemons(state)).length, 2, 'the command daemons keep running');
    edge.current = await openEdge(state);
    assert.equal(await echo(edge.current, id, 'after'), 'after\n');
    assert.equal(await supervisorPid(state), undefined, 'commands need no supervisor');
  });
});

test('after a killed supervisor, running sandboxes keep working and a new sandbox gets a fresh one', async () => {
  await withState(async (state, edge) => {
    const a = await edge.current.createSandbox({
      id: randomId('sb'),
      projectId: 'p1',
      spec: spec(),
    });
    const first = await supervisorPid(state);
    assert.ok(first !== undefined);
    process.kill(first, 'SIGKILL');
    await sleep(100);
    assert.equal(await echo(edge.current, a.id, 'still'), 'still\n');
    const b = await edge.current.createSandbox({
      id: randomId('sb'),
      projectId: 'p1',
      spec: spec(),
    });
    const second = await supervisorPid(state);
    assert.ok(second !== undefined && second !== first, 'a fresh supervisor');
    assert.equal(await echo(edge.current, b.id, 'fresh'), 'fresh\n');
    assert.equal(await echo(edge.current, a.id, 'both'), 'both\n');
  });
});

test('a killed command daemon is started again by the next edge; ps shows no sandbox path', async () => {
  await withState(async (state, edge) => {
    const sb = await edge.current.createSandbox({
      id: randomId('sb'),
      projectId: 'p1',
      spec: spec(),
    });
    const [daemon] = await daemons(state);
    assert.ok(daemon !== undefined);
    const cmdline = await readFile(`/proc/${daemon}/cmdline`, 'utf8');
    assert.doesNotMatch(cmdline, new RegExp(state.dir), 'no state dir in the command line');
    process.kill(daemon, 'SIGKILL');
    await sleep(100);
    await edge.current.close();
    edge.current = await openEdge(state); // reconcile: ensureChronus
    const [restarted] = await daemons(state);
    assert.ok(restarted !== undefined && restarted !== daemon, 'a new daemon');
    assert.equal(await echo(edge.current, sb.id, 'back'), 'back\n');
  });
});
