import { useState } from 'preact/hooks';
import { api, enc } from './api.js';
import type { LayerInfo, Project, SandboxInfo, SandboxState } from './api.js';
import { parseLabels, relative } from './format.js';
import { ErrorLine, usePoll } from './hooks.js';

/** The list holds live sandboxes only (a stopped one is still found by its ID). */
const STATES: SandboxState[] = ['creating', 'running', 'paused', 'stopping'];

export function StateBadge({ state }: { state: string }) {
  return <span class={`badge state-${state}`}>{state}</span>;
}

export function Labels({ labels }: { labels: Record<string, string> }) {
  return (
    <>
      {Object.entries(labels).map(([k, v]) => (
        <span class="label">
          {k}={v}
        </span>
      ))}
    </>
  );
}

function CreateForm({ onCreated }: { onCreated: (id: string) => void }) {
  const images = usePoll((signal) => api<{ layers: LayerInfo[] }>('/v1/images', { signal }), [], 0);
  const bases = (images.data?.layers ?? []).filter((l) => l.kind === 'base');
  const [image, setImage] = useState('');
  const [memoryMb, setMemoryMb] = useState(512);
  const [ttlSeconds, setTtl] = useState(3600);
  const [labels, setLabels] = useState('');
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState<Error>();
  const chosen = image || (bases[0] ? `${bases[0].name}:${bases[0].version}` : '');
  const submit = async (e: Event) => {
    e.preventDefault();
    setBusy(true);
    setError(undefined);
    try {
      const sb = await api<SandboxInfo>('/v1/sandboxes', {
        method: 'POST',
        body: {
          image: chosen,
          memoryLimitMb: memoryMb,
          ttlSeconds,
          labels: parseLabels(labels),
          requestId: `ui-${crypto.randomUUID()}`,
        },
      });
      onCreated(sb.id);
    } catch (err) {
      setError(err as Error);
    } finally {
      setBusy(false);
    }
  };
  return (
    <form class="create" onSubmit={(e) => void submit(e)}>
      <label>
        Image
        <select name="image" value={chosen} onChange={(e) => setImage(e.currentTarget.value)}>
          {bases.map((l) => (
            <option value={`${l.name}:${l.version}`}>
              {l.name}:{l.version}
            </option>
          ))}
        </select>
      </label>
      <label>
        Memory (MiB)
        <input
          type="number"
          min={16}
          value={memoryMb}
          onInput={(e) => setMemoryMb(Number(e.currentTarget.value))}
        />
      </label>
      <label>
        TTL (s)
        <input
          type="number"
          min={1}
          value={ttlSeconds}
          onInput={(e) => setTtl(Number(e.currentTarget.value))}
        />
      </label>
      <label>
        Labels
        <input
          name="labels"
          placeholder="team=rl, task=42"
          value={labels}
          onInput={(e) => setLabels(e.currentTarget.value)}
        />
      </label>
      <button type="submit" disabled={busy || !chosen}>
        {busy ? 'Creating…' : 'Create sandbox'}
      </button>
      <ErrorLine error={error ?? images.error} />
    </form>
  );
}

export function SandboxesPage() {
  const [project, setProject] = useState('');
  const [label, setLabel] = useState('');
  const [state, setState] = useState('');
  const [creating, setCreating] = useState(false);
  const projects = usePoll(
    (signal) => api<{ projects: Project[] }>('/v1/projects', { signal }),
    [],
    0,
  );
  const query = new URLSearchParams();
  if (project) query.set('projectId', project);
  for (const [k, v] of Object.entries(parseLabels(label))) query.append('label', `${k}=${v}`);
  const qs = query.toString();
  const list = usePoll(
    (signal) => api<{ sandboxes: SandboxInfo[] }>(`/v1/sandboxes${qs ? `?${qs}` : ''}`, { signal }),
    [qs],
  );
  const names = new Map((projects.data?.projects ?? []).map((p) => [p.id, p.name]));
  const now = Date.now();
  const rows = (list.data?.sandboxes ?? [])
    .filter((s) => !state || s.state === state)
    .sort((a, b) => b.createdAt.localeCompare(a.createdAt));
  const stop = async (id: string) => {
    await api(`/v1/sandboxes/${enc(id)}`, { method: 'DELETE' }).catch((err: Error) =>
      alert(err.message),
    );
    list.reload();
  };
  return (
    <section>
      <div class="toolbar">
        <h2>Sandboxes</h2>
        <button onClick={() => setCreating(!creating)}>
          {creating ? 'Cancel' : 'New sandbox'}
        </button>
      </div>
      {creating && <CreateForm onCreated={(id) => (location.hash = `#/sandboxes/${enc(id)}`)} />}
      <div class="filters">
        <select
          aria-label="project"
          value={project}
          onChange={(e) => setProject(e.currentTarget.value)}
        >
          <option value="">all projects</option>
          {(projects.data?.projects ?? []).map((p) => (
            <option value={p.id}>{p.name}</option>
          ))}
        </select>
        <input
          aria-label="labels"
          placeholder="label filter: k=v, k2=v2"
          value={label}
          onChange={(e) => setLabel(e.currentTarget.value)}
        />
        <select aria-label="state" value={state} onChange={(e) => setState(e.currentTarget.value)}>
          <option value="">any state</option>
          {STATES.map((s) => (
            <option value={s}>{s}</option>
          ))}
        </select>
        <span class="muted">{rows.length} shown · refreshed every 2 s</span>
      </div>
      <ErrorLine error={list.error} />
      <table class="sandboxes">
        <thead>
          <tr>
            <th>ID</th>
            <th>State</th>
            <th>Project</th>
            <th>Image</th>
            <th>Resources</th>
            <th>Created</th>
            <th>Expires</th>
            <th>Labels</th>
            <th />
          </tr>
        </thead>
        <tbody>
          {rows.map((s) => (
            <tr data-id={s.id}>
              <td>
                <a href={`#/sandboxes/${enc(s.id)}`} class="mono">
                  {s.id}
                </a>
              </td>
              <td>
                <StateBadge state={s.state} />
              </td>
              <td title={s.projectId}>{names.get(s.projectId) ?? s.projectId}</td>
              <td class="mono">{s.spec.image}</td>
              <td>
                {s.spec.memoryLimitMb} MiB · {s.spec.cpuCoresLimit} CPU
              </td>
              <td title={s.createdAt}>{relative(s.createdAt, now)}</td>
              <td title={s.expiresAt}>
                {s.state === 'running' ? relative(s.expiresAt, now) : '–'}
              </td>
              <td>
                <Labels labels={s.spec.labels} />
              </td>
              <td>
                {(s.state === 'running' || s.state === 'paused') && (
                  <button class="danger small" onClick={() => void stop(s.id)}>
                    Stop
                  </button>
                )}
              </td>
            </tr>
          ))}
        </tbody>
      </table>
      {list.data && rows.length === 0 && <p class="muted">No sandboxes.</p>}
    </section>
  );
}
