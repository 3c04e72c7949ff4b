import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { EdgeMetrics, FNCALL_RUNTIME_LABEL, type Edge } from '@dsec/edge';
import type { FnCallRequest, FnCallResult } from '@dsec/core';
import { openFnCallEdge, removeStateDir } from './fncall-fixture.js';

// One worker per pool (max 1): every call of a runtime runs in the same
// sandbox, so what one call leaves behind is exactly what the next would see.
let edge: Edge;
let close: () => Promise<void>;
const metrics = new EdgeMetrics();

before(async () => {
  const f = await openFnCallEdge({ sizing: { min: 1, max: 1, spare: 0 } }, metrics);
  edge = f.edge;
  close = async () => {
    await f.close();
    await removeStateDir(f.stateDir, f.cgroupParent);
  };
});

after(async () => {
  await close();
});

const call = (req: Partial<FnCallRequest> & { code: string }): Promise<FnCallResult> =>
  edge.fncall({ language: 'python', ...req }, { projectId: 'p1' });

/** The python pool's worker(s). */
async function workerIds(): Promise<string[]> {
  return (await edge.listSandboxes({ projectIds: ['_fncall'] }))
    .filter((s) => s.state === 'running' && s.spec.labels[FNCALL_RUNTIME_LABEL] === 'python')
    .map((s) => s.id);
}

void describe('fncall: no state crosses calls', () => {
  test('files, background processes, env, /tmp and IPC of one call are gone for the next', async () => {
    const dirty = await call({
      timeoutMs: 20_000,
      code: `
import ctypes, os, subprocess, sys
for p in ['/tmp/t', '/var/tmp/v', '/dev/shm/s', os.path.expanduser('~/h'), 'cwd-file']:
    with open(p, 'w') as f:
        f.write('left over')
os.makedirs('/tmp/deep/er')
with open('/tmp/fill', 'wb') as f:
    f.write(b'\\0' * (48 << 20))
os.chmod('.', 0o777)
# A daemon: double fork and setsid, then it lingers.
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        import time
        while True:
            time.sleep(1)
    os._exit(0)
os.wait()
subprocess.Popen(['sleep', '1000'], start_new_session=True)
subprocess.Popen(['sh', '-c', 'nohup sleep 1000 >/dev/null 2>&1 &'])
os.environ['LEAK'] = '1'
libc = ctypes.CDLL(None)
assert libc.shmget(0x1234, 4096, 0o1666) >= 0
assert libc.semget(0x1235, 1, 0o1666) >= 0
assert libc.msgget(0x1236, 0o1666) >= 0
# Nothing outside the scratch places is writable.
refused = []
for p in ['/etc/leak', '/leak', '/usr/lib/leak', '/var/lib/leak', '/run/leak', '/root/leak', '/fncall/leak', '/var/lock/leak', '/run/lock/leak']:
    try:
        open(p, 'w').close()
    except OSError:
        refused.append(p)
print(len(refused), os.uname().nodename)
`,
    });
    assert.equal(dirty.outcome, 'ok', dirty.stderr);
    const [refused, host] = dirty.stdout.trim().split(' ');
    assert.equal(refused, '9', 'no path outside the scratch places could be written');

    const clean = await call({
      code: `
import json, os
me = os.getpid()
procs = [e for e in os.listdir('/proc') if e.isdigit() and int(e) != me and os.stat('/proc/' + e).st_uid == os.getuid()]
ipc = [l for k in ('shm', 'sem', 'msg') for l in open('/proc/sysvipc/' + k).read().splitlines()[1:]]
print(json.dumps({
  'host': os.uname().nodename,
  'tmp': os.listdir('/tmp'), 'vartmp': os.listdir('/var/tmp'), 'shm': os.listdir('/dev/shm'),
  'cwd': os.listdir('.'), 'home': os.listdir(os.path.expanduser('~')),
  'cwdMode': oct(os.stat('.').st_mode & 0o777), 'leak': os.environ.get('LEAK'), 'procs': procs, 'ipc': ipc,
}))
`,
    });
    assert.equal(clean.outcome, 'ok', clean.stderr);
    const seen = JSON.parse(clean.stdout) as Record<string, unknown>;
    assert.equal(seen['host'], host, 'the same worker ran both calls');
    assert.deepEqual(
      { ...seen, host: undefined },
      {
        host: undefined,
        tmp: [],
        vartmp: [],
        shm: [],
        cwd: [],
        home: [],
        cwdMode: '0o700',
        leak: null,
        procs: [],
        ipc: [],
      },
    );
    assert.equal((await workerIds()).length, 1);
  });

  // The zygote cleans the scratch places only after a call that changed one of them (an
  // inotify watch on each): every way of leaving something there, one place at a time.
  test('each scratch place is cleaned after a call that changed only it', async () => {
    const check = `
import json, os
print(json.dumps({d: sorted(os.listdir(d)) for d in ('/tmp', '/var/tmp', '/dev/shm', '/dev/mqueue', '.', os.path.expanduser('~'))}),
      oct(os.stat('.').st_mode & 0o777), oct(os.stat(os.path.expanduser('~')).st_mode & 0o777))
`;
    const empty = await call({ code: check });
    assert.equal(empty.outcome, 'ok', empty.stderr);
    const ways = {
      'a file in /tmp': "open('/tmp/a', 'w').close()",
      'a directory in /var/tmp': "os.mkdir('/var/tmp/d')",
      'shared memory in /dev/shm': "open('/dev/shm/s', 'w').close()",
      'a POSIX message queue':
        "import ctypes\nassert ctypes.CDLL(None).mq_open(b'/q', os.O_CREAT | os.O_RDWR, 0o600, None) >= 0",
      'a hard link made in the work dir':
        "open('/tmp/x', 'w').close()\nos.link('/tmp/x', 'x')\nos.unlink('/tmp/x')",
      'a file moved from /var/tmp into HOME':
        "open('/var/tmp/m', 'w').close()\nos.rename('/var/tmp/m', os.path.expanduser('~/m'))",
      'the work dir made world-writable': "os.chmod('.', 0o777)",
      'HOME made world-readable': "os.chmod(os.path.expanduser('~'), 0o755)",
    };
    for (const [way, code] of Object.entries(ways)) {
      const dirty = await call({ code: `import os\n${code}\nprint(sorted(os.listdir('.')))` });
      assert.equal(dirty.outcome, 'ok', `${way}: ${dirty.stderr}`);
      const after = await call({ code: check });
      assert.equal(after.stdout, empty.stdout, `${way} was left for the next call`);
    }
  });

  test('the edge counts calls by runtime and outcome, and reports its worker', async () => {
    const sample = async (series: string) => {
      const line = (await metrics.registry.metrics())
        .split('\n')
        .find((l) => l.startsWith(`${series} `));
      return line === undefined ? 0 : Number(line.split(' ')[1]);
    };
    const ok = await sample('dsec_fncall_calls_total{runtime="python",outcome="ok"}');
    const refused = await sample('dsec_fncall_errors_total{code="invalid_argument"}');
    assert.equal((await call({ code: 'print(1)' })).outcome, 'ok');
    await assert.rejects(call({ code: 'print(1)', language: 'cobol' }));
    assert.equal(await sample('dsec_fncall_calls_total{runtime="python",outcome="ok"}'), ok + 1);
    assert.equal(await sample('dsec_fncall_errors_total{code="invalid_argument"}'), refused + 1);
    assert.equal(await sample('dsec_fncall_workers{runtime="python",state="idle"}'), 1);
  });

  test('the random generator is reseeded per call, and in a process the call forks', async () => {
    const code = `
import os, random
r, w = os.pipe()
if os.fork() == 0:
    os.write(w, str(random.random()).encode())
    os._exit(0)
os.wait()
print(random.random(), os.read(r, 100).decode())
`;
    const a = (await call({ code })).stdout.trim().split(' ');
    const b = (await call({ code })).stdout.trim().split(' ');
    assert.equal(new Set([...a, ...b]).size, 4, `${a} ${b}`);
  });
});

void describe('fncall: programs', () => {
  test('stdin, args, env, files and exit codes (python)', async () => {
    const r = await call({
      code: 'import os, sys\nfrom helper import twice\nprint(twice(sum(map(int, input().split()))), sys.argv[1:], os.environ["X"], open("data/in.txt").read())\nsys.exit(3)',
      stdin: '1 2 3\n',
      args: ['a', 'b c'],
      env: { X: 'y' },
      files: { 'helper.py': 'def twice(n):\n    return 2 * n\n', 'data/in.txt': 'file' },
    });
    assert.equal(r.stdout, "12 ['a', 'b c'] y file\n");
    assert.equal(r.exitCode, 3);
    assert.equal(r.outcome, 'ok');
  });

  test('python sees the call environment, as its subprocesses do, and a seekable stdin', async () => {
    const r = await call({
      code: [
        'import os, subprocess, sys',
        'print(sorted(os.environ))',
        'print(subprocess.run(["sh", "-c", "echo $X $HOME $PWD"], capture_output=True, text=True).stdout.strip())',
        'print(sys.stdin.seekable(), sys.stdin.read().strip(), sys.stdin.seek(0), sys.stdin.read().strip())',
      ].join('\n'),
      stdin: 'in\n',
      env: { X: 'y' },
    });
    assert.equal(r.outcome, 'ok', r.stderr);
    const [keys, shell, stdin] = r.stdout.split('\n');
    assert.ok(keys?.includes("'X'") && keys.includes("'HOME'") && keys.includes("'TMPDIR'"), keys);
    assert.equal(shell, 'y /fncall/home /fncall/work');
    assert.equal(stdin, 'True in 0 in');
  });

  test('a call without env of its own sees the base environment, not an earlier call’s', async () => {
    const withEnv = await call({ code: 'import os; print(os.environ["X"])', env: { X: 'y' } });
    assert.equal(withEnv.stdout, 'y\n');
    const r = await call({
      code: [
        'import os, subprocess',
        'print(os.environ.get("X"), os.environ["HOME"], os.environ["PWD"], os.environ["TMPDIR"])',
        'print(subprocess.run(["sh", "-c", "echo ${X:-none} $HOME"], capture_output=True, text=True).stdout.strip())',
      ].join('\n'),
    });
    assert.equal(r.outcome, 'ok', r.stderr);
    assert.equal(r.stdout, 'None /fncall/home /fncall/work /tmp\nnone /fncall/home\n');
  });

  test('syntax errors and warnings reach the call’s stderr as python prints them', async () => {
    const r = await call({ code: 'print(1)\nif True print(2)\n' });
    assert.equal(r.exitCode, 1);
    assert.match(r.stderr, /^ {2}File "\/fncall\/work\/main.py", line 2\n/);
    assert.match(r.stderr, /SyntaxError: /);
    assert.doesNotMatch(r.stderr, /zygote|prepare|run_python|<string>/);
    assert.equal(r.stdout, '');
    // A warning of the compiler (the zygote compiles short programs before the fork).
    const w = await call({ code: 'x = 1\nprint(x is 1)\n' });
    assert.equal(w.outcome, 'ok', w.stderr);
    assert.equal(w.stdout, 'True\n');
    assert.match(w.stderr, /main\.py:2: SyntaxWarning: "is" with a literal/);
  });

  test('an exception exits 1 with its traceback, source line included', async () => {
    const r = await call({ code: 'x = 1\ny = x // 0\n' });
    assert.equal(r.exitCode, 1);
    assert.match(
      r.stderr,
      /^Traceback \(most recent call last\):\n {2}File "[^"]*main.py", line 2, in <module>\n\s+y = x \/\/ 0\n/,
    );
  });

  test('node and bash run their programs with args, stdin and env', async () => {
    const n = await edge.fncall(
      {
        language: 'node',
        code: 'let s="";process.stdin.on("data",d=>s+=d).on("end",()=>{console.log(s.trim().split(" ").map(Number).reduce((a,b)=>a+b), process.argv.slice(2), process.env.X)})',
        stdin: '4 5',
        args: ['q'],
        env: { X: 'z' },
      },
      { projectId: 'p1' },
    );
    assert.equal(n.stdout, "9 [ 'q' ] z\n", n.stderr);
    const b = await edge.fncall(
      {
        language: 'bash',
        code: 'read a b; echo $((a+b)) "$1" "$X" $(id -u); exit 4',
        stdin: '2 3\n',
        args: ['w'],
        env: { X: 'v' },
      },
      { projectId: 'p1' },
    );
    assert.equal(b.stdout, '5 w v 60000\n');
    assert.equal(b.exitCode, 4);
  });

  test('unknown languages and bad requests are invalid_argument', async () => {
    await assert.rejects(edge.fncall({ language: 'cobol', code: '' }, { projectId: 'p1' }), {
      code: 'invalid_argument',
      field: 'language',
    });
    await assert.rejects(call({ code: '', timeoutMs: 0 }), {
      code: 'invalid_argument',
      field: 'timeoutMs',
    });
    await assert.rejects(call({ code: '', files: { '../x': '' } }), { code: 'invalid_argument' });
  });
});

void describe('fncall: limits', () => {
  test('timeout', async () => {
    const r = await call({ code: 'while True: pass', timeoutMs: 1000 });
    assert.equal(r.outcome, 'timeout');
    assert.equal(r.exitCode, 137);
    assert.ok(r.durationMs >= 1000);
  });

  test('memory: past memoryMb the call ends with oom', async () => {
    const r = await call({ code: 'x = bytearray(400 << 20)\nprint("no")', memoryMb: 128 });
    assert.equal(r.outcome, 'oom');
    assert.equal(r.stdout, '');
    assert.match(r.stderr, /MemoryError/);
  });

  test('memory: node past memoryMb ends with oom, whether V8 aborts or throws', async () => {
    const full = await call({
      language: 'node',
      code: 'const a = []; while (true) a.push(new Array(1e6).fill(1.5));',
      memoryMb: 256,
    });
    assert.equal(full.outcome, 'oom', full.stderr.slice(-300));
    assert.equal(full.exitCode, 134);
    const buffer = await call({
      language: 'node',
      code: 'const a = []; while (true) a.push(Buffer.alloc(1 << 24, 1));',
      memoryMb: 256,
    });
    assert.equal(buffer.outcome, 'oom', buffer.stderr.slice(-300));
    assert.equal(buffer.exitCode, 1);
    // A program that fails otherwise is not oom.
    const thrown = await call({ language: 'node', code: 'throw new Error("no")' });
    assert.equal(thrown.outcome, 'ok');
    assert.equal(thrown.exitCode, 1);
  });

  test('output past maxOutputBytes ends the call with output_limit, truncated', async () => {
    const r = await call({
      code: 'import sys\nwhile True: sys.stdout.write("x" * 65536)',
      maxOutputBytes: 1000,
    });
    assert.equal(r.outcome, 'output_limit');
    assert.equal(r.truncated, true);
    assert.equal(r.stdout, 'x'.repeat(1000));
  });

  test('signals end a call as signaled with 128 + the signal', async () => {
    const r = await call({ code: 'import os, signal\nos.kill(os.getpid(), signal.SIGTERM)' });
    assert.equal(r.outcome, 'signaled');
    assert.equal(r.exitCode, 143);
  });

  test('fork bombs stop at the call’s pids limit and are cleaned away', async () => {
    const bash = await edge.fncall(
      { language: 'bash', code: 'b() { b | b & }; b; sleep 3', timeoutMs: 3000 },
      { projectId: 'p1' },
    );
    assert.equal(bash.outcome, 'pids_limit');
    const py = await call({
      code: 'import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass',
      timeoutMs: 2000,
    });
    assert.equal(py.outcome, 'pids_limit');
    const after = await call({ code: 'print("fine")' });
    assert.equal(after.stdout, 'fine\n');
  });

  test('a call cannot kill its worker; the next call runs', async () => {
    const before = await workerIds();
    const r = await call({
      code: `
import os, signal
errs = []
for pid in (1, os.getppid(), -1):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError as e:
        errs.append(e.errno)
print(errs)
`,
    });
    // kill(-1) as the call uid only reaches the call's own processes (none besides itself).
    assert.match(r.stdout, /^\[1, 1(, 3)?\]\n$/);
    assert.equal((await call({ code: 'print(2)' })).stdout, '2\n');
    assert.deepEqual(await workerIds(), before);
  });

  test('a worker that dies during a call fails only that call; a new worker takes the next', async () => {
    const [worker] = await workerIds();
    const running = call({ code: 'import time; time.sleep(30)', timeoutMs: 60_000 });
    await new Promise((r) => setTimeout(r, 500));
    await edge.stopSandbox(worker!);
    const r = await running;
    assert.equal(r.outcome, 'runtime_error');
    assert.match(r.reason ?? '', /worker/);
    const next = await call({ code: 'print("again")' });
    assert.equal(next.stdout, 'again\n');
    const now = await workerIds();
    assert.equal(now.length, 1);
    assert.notEqual(now[0], worker);
  });

  test('limits are recorded as the sandbox command path records them', async () => {
    const [worker] = await workerIds();
    await call({ code: 'while True: pass', timeoutMs: 500 });
    await call({ code: 'print("x" * 5000)', maxOutputBytes: 10 });
    await call({ code: 'x = bytearray(400 << 20)', memoryMb: 64 });
    const kinds = new Set<string>((await edge.listEvents(worker!, {})).map((e) => e.kind));
    for (const kind of ['command_timeout', 'output_truncated', 'oom_killed'])
      assert.ok(kinds.has(kind), `${kind} in ${[...kinds].join()}`);
  });
});
