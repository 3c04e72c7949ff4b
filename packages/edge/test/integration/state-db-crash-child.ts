// Child of state-db-crash.test.ts: writes to the state databases as fast as it
// can and prints one line per write *after* the write returned (stdout on a
// pipe is synchronous on Linux), until it is killed with SIGKILL.
import { readFileSync, writeFileSync } from 'node:fs';
import type { CommandInfo, CommandResult } from '@dsec/core';
import { openControlDb } from '@dsec/iam';
import { CommandStore } from '../../src/state/command-store.js';
import { EdgeStore } from '../../src/state/edge-store.js';

const dir = process.argv[2]!;
const { iam } = await openControlDb(`${dir}/iam.db`);
// The first run bootstraps the root project and keeps its key for the next runs.
const root = await iam.bootstrap();
if (root.key) writeFileSync(`${dir}/admin.key`, root.key);
const caller = await iam.authenticate(readFileSync(`${dir}/admin.key`, 'utf8'));
const edge = new EdgeStore(`${dir}/edge.db`);
const commands = new CommandStore(`${dir}/edge.db`);
const say = (line: string) => process.stdout.write(`${line}\n`);

say('ready');
// A project holds at most 1000 children: a fast machine writes more than that before the kill,
// so each 500 go under a fresh parent of their own.
let parentId: string | undefined;
for (let i = 0; ; i++) {
  if (i % 500 === 0) {
    parentId = (await iam.createProject(caller, { name: `batch${process.pid}-${i}` })).id;
  }
  const project = await iam.createProject(caller, { name: `p${process.pid}-${i}`, parentId });
  say(`P ${project.id}`);
  const now = new Date().toISOString();
  const sandbox = edge.insert({
    id: `sb-${process.pid}-${i}`,
    projectId: project.id,
    spec: {
      backend: 'container',
      image: 'busybox',
      toolkits: [],
      memoryLimitMb: 512,
      cpuCoresLimit: 1,
      pidsLimit: 512,
      ttlSeconds: 600,
      networkRules: {},
      initUser: 'root',
      env: {},
      labels: {},
    },
    layers: [],
    createdAt: now,
    expiresAt: now,
  });
  say(`S ${sandbox.id}`);
  const info = {
    commandId: `cmd-${process.pid}-${i}`,
    sandboxId: sandbox.id,
    requestId: `req-${i}`,
    argv: ['true'],
    background: false,
    state: 'running' as const,
    startedAt: now,
  };
  // Odd rounds take the foreground path: a start that shares its result's
  // group commit (not acknowledged on its own), then `finishGrouped`.
  const grouped = i % 2 === 1;
  commands.insert(info, { durable: !grouped });
  if (!grouped) say(`C ${info.commandId}`);
  const finished: CommandInfo & { result: CommandResult; finishedAt: string } = {
    ...info,
    state: 'finished',
    result: {
      commandId: info.commandId,
      exitCode: 0,
      outcome: 'exited',
      stdout: `out-${i}`,
      stderr: '',
      truncated: false,
      stdoutBytes: 6,
      stderrBytes: 0,
      durationMs: 1,
    },
    finishedAt: new Date().toISOString(),
  };
  if (grouped) await commands.finishGrouped(finished);
  else commands.finish(finished);
  say(`R ${info.commandId}`);
}
