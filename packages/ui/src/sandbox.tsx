import { useState } from 'preact/hooks';
import { api, enc } from './api.js';
import type { CommandInfo, SandboxEvent, SandboxInfo } from './api.js';
import { bytes, relative } from './format.js';
import { ErrorLine, usePoll } from './hooks.js';
import { Labels, StateBadge } from './sandboxes.js';
import { TerminalView } from './terminal.js';
import { FileBrowser } from './files.js';

const TABS = ['terminal', 'files', 'commands', 'events', 'spec'] as const;
type Tab = (typeof TABS)[number];

function Commands({ id }: { id: string }) {
  const list = usePoll(
    (signal) => api<{ commands: CommandInfo[] }>(`/v1/sandboxes/${enc(id)}/commands`, { signal }),
    [id],
    3000,
  );
  const [shown, setShown] = useState<string>();
  const now = Date.now();
  return (
    <div>
      <ErrorLine error={list.error} />
      <table>
        <thead>
          <tr>
            <th>Command</th>
            <th>State</th>
            <th>Exit</th>
            <th>Started</th>
            <th>Duration</th>
          </tr>
        </thead>
        <tbody>
          {[...(list.data?.commands ?? [])].reverse().map((c) => (
            <>
              <tr>
                <td class="mono">
                  <button
                    class="link"
                    onClick={() => setShown(shown === c.commandId ? undefined : c.commandId)}
                  >
                    {c.line ?? c.argv?.join(' ') ?? c.commandId}
                  </button>
                </td>
                <td>{c.state}</td>
                <td>{c.result ? `${c.result.exitCode} (${c.result.outcome})` : ''}</td>
                <td title={c.startedAt}>{relative(c.startedAt, now)}</td>
                <td>{c.result ? `${Math.round(c.result.durationMs)} ms` : ''}</td>
              </tr>
              {shown === c.commandId && c.result && (
                <tr>
                  <td colSpan={5}>
                    <pre>{c.result.stdout}</pre>
                    {c.result.stderr && <pre class="stderr">{c.result.stderr}</pre>}
                  </td>
                </tr>
              )}
            </>
          ))}
        </tbody>
      </table>
      {list.data?.commands.length === 0 && <p class="muted">No commands run yet.</p>}
    </div>
  );
}

function Events({ id }: { id: string }) {
  const list = usePoll(
    (signal) =>
      api<{ events: SandboxEvent[] }>(`/v1/sandboxes/${enc(id)}/events?limit=200`, { signal }),
    [id],
    3000,
  );
  return (
    <div>
      <ErrorLine error={list.error} />
      <table>
        <tbody>
          {[...(list.data?.events ?? [])].reverse().map((e) => (
            <tr>
              <td class="mono">{e.time}</td>
              <td>
                <span class="badge">{e.kind}</span>
              </td>
              <td>{e.message}</td>
              <td class="num">{e.count > 1 ? `×${e.count}` : ''}</td>
            </tr>
          ))}
        </tbody>
      </table>
      {list.data?.events.length === 0 && <p class="muted">No events.</p>}
    </div>
  );
}

export function SandboxPage({ id }: { id: string }) {
  const [tab, setTab] = useState<Tab>('terminal');
  const sb = usePoll((signal) => api<SandboxInfo>(`/v1/sandboxes/${enc(id)}`, { signal }), [id]);
  const [error, setError] = useState<Error>();
  const act = async (path: string, method = 'POST') => {
    setError(undefined);
    await api(`/v1/sandboxes/${enc(id)}${path}`, { method }).catch((err: Error) => setError(err));
    sb.reload();
  };
  const s = sb.data;
  const now = Date.now();
  const live = s?.state === 'running' || s?.state === 'paused';
  return (
    <section>
      <p>
        <a href="#/sandboxes">← Sandboxes</a>
      </p>
      <div class="toolbar">
        <h2 class="mono">{id}</h2>
        {s && <StateBadge state={s.state} />}
        {s?.state === 'running' && <button onClick={() => void act('/pause')}>Pause</button>}
        {s?.state === 'paused' && <button onClick={() => void act('/resume')}>Resume</button>}
        {live && (
          <button class="danger" onClick={() => void act('', 'DELETE')}>
            Stop
          </button>
        )}
      </div>
      <ErrorLine error={error ?? sb.error} />
      {s && (
        <dl class="facts">
          <dt>Project</dt>
          <dd>{s.projectId}</dd>
          <dt>Node</dt>
          <dd>{s.edgeId}</dd>
          <dt>Image</dt>
          <dd class="mono">
            {[s.spec.image, s.spec.workspace, ...s.spec.toolkits].filter(Boolean).join(' + ')}
          </dd>
          <dt>Limits</dt>
          <dd>
            {s.spec.memoryLimitMb} MiB · {s.spec.cpuCoresLimit} CPU
            {s.memoryBytes !== undefined && ` · using ${bytes(s.memoryBytes)}`}
          </dd>
          <dt>Created</dt>
          <dd title={s.createdAt}>{relative(s.createdAt, now)}</dd>
          <dt>Expires</dt>
          <dd title={s.expiresAt}>{s.state === 'running' ? relative(s.expiresAt, now) : '–'}</dd>
          {s.reason && (
            <>
              <dt>Reason</dt>
              <dd>{s.reason}</dd>
            </>
          )}
          <dt>Labels</dt>
          <dd>
            <Labels labels={s.spec.labels} />
          </dd>
        </dl>
      )}
      <nav class="tabs">
        {TABS.map((t) => (
          <button class={tab === t ? 'active' : ''} onClick={() => setTab(t)}>
            {t}
          </button>
        ))}
      </nav>
      {tab === 'terminal' &&
        (s?.state === 'running' ? (
          <TerminalView id={id} />
        ) : (
          <p class="muted">The terminal needs a running sandbox.</p>
        ))}
      {tab === 'files' && (live ? <FileBrowser id={id} /> : <p class="muted">Not running.</p>)}
      {tab === 'commands' && <Commands id={id} />}
      {tab === 'events' && <Events id={id} />}
      {tab === 'spec' && s && <pre>{JSON.stringify(s.spec, null, 2)}</pre>}
    </section>
  );
}
