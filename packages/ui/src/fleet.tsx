import { api } from './api.js';
import type { EdgeStatus, LayerInfo, Project, SandboxInfo } from './api.js';
import { bytes, percent } from './format.js';
import { ErrorLine, usePoll } from './hooks.js';

function Meter({ used, total, unit }: { used: number; total: number; unit: string }) {
  const p = percent(used, total);
  return (
    <div class="meter" title={`${p}%`}>
      <div class={`fill ${p >= 90 ? 'hot' : ''}`} style={{ width: `${p}%` }} />
      <span>
        {Math.round(used * 10) / 10} / {Math.round(total * 10) / 10} {unit}
      </span>
    </div>
  );
}

/** Nodes: the apiserver's view of its edges (health, load, capacity); root admins only. */
export function NodesPage() {
  const edges = usePoll(
    (signal) => api<{ edges: EdgeStatus[] }>('/v1/edges', { signal }),
    [],
    3000,
  );
  return (
    <section>
      <h2>Nodes</h2>
      <ErrorLine error={edges.error} />
      <table>
        <thead>
          <tr>
            <th>Node</th>
            <th>Health</th>
            <th>Sandboxes</th>
            <th>Memory (reserved)</th>
            <th>CPU (reserved)</th>
            <th>Host load</th>
            <th>Backends</th>
          </tr>
        </thead>
        <tbody>
          {(edges.data?.edges ?? []).map((e) => (
            <tr>
              <td>
                <strong>{e.edgeId}</strong>
                <div class="muted mono">{e.url}</div>
              </td>
              <td>
                <span class={`badge ${e.healthy ? 'state-running' : 'state-failed'}`}>
                  {e.healthy ? 'healthy' : 'unhealthy'}
                </span>
                {e.cordoned && (
                  <span class="badge state-paused" title="dsec edge uncordon to take new sandboxes">
                    cordoned
                  </span>
                )}
                {e.pressure?.refusing && (
                  <div class="error">
                    refusing: {e.pressure.refusing.resource} ({e.pressure.refusing.measure})
                  </div>
                )}
              </td>
              <td>
                <Meter used={e.used.sandboxes} total={e.capacity.sandboxes} unit="" />
              </td>
              <td>
                <Meter used={e.used.memoryMb} total={e.capacity.memoryMb} unit="MiB" />
              </td>
              <td>
                <Meter used={e.used.cpuCores} total={e.capacity.cpuCores} unit="cores" />
              </td>
              <td>
                {e.pressure ? (
                  <>
                    <Meter
                      used={e.pressure.memoryTotalMb - e.pressure.memoryAvailableMb}
                      total={e.pressure.memoryTotalMb}
                      unit="MiB host"
                    />
                    <div class="muted">
                      CPU pressure {Math.round(e.pressure.cpuPressurePercent)}% · threads{' '}
                      {e.pressure.threads}/{e.pressure.threadsLimit} · disk free{' '}
                      {bytes(e.pressure.diskFreeMb * 1024 * 1024)}
                    </div>
                  </>
                ) : (
                  <span class="muted">not measured</span>
                )}
              </td>
              <td>{e.backends.join(', ')}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </section>
  );
}

function ProjectNode({
  project,
  children,
  running,
}: {
  project: Project;
  children: Map<string | null, Project[]>;
  running: Map<string, SandboxInfo[]>;
}) {
  const mine = running.get(project.id) ?? [];
  const memoryMb = mine.reduce((a, s) => a + s.spec.memoryLimitMb, 0);
  const cpu = mine.reduce((a, s) => a + s.spec.cpuCoresLimit, 0);
  const q = project.quota;
  return (
    <li>
      <div class="project">
        <strong>{project.name}</strong> <span class="muted mono">{project.id}</span>
        <span class="quota">
          sandboxes {mine.length}
          {q.sandboxes !== undefined ? ` / ${q.sandboxes}` : ''} · memory {memoryMb}
          {q.memoryMb !== undefined ? ` / ${q.memoryMb}` : ''} MiB · CPU {cpu}
          {q.cpuCores !== undefined ? ` / ${q.cpuCores}` : ''}
        </span>
      </div>
      {(children.get(project.id) ?? []).length > 0 && (
        <ul>
          {(children.get(project.id) ?? []).map((c) => (
            <ProjectNode project={c} children={children} running={running} />
          ))}
        </ul>
      )}
    </li>
  );
}

/** Projects as a tree with their quotas, against what their live sandboxes reserve. */
export function ProjectsPage() {
  const projects = usePoll(
    (signal) => api<{ projects: Project[] }>('/v1/projects', { signal }),
    [],
    5000,
  );
  const sandboxes = usePoll(
    (signal) => api<{ sandboxes: SandboxInfo[] }>('/v1/sandboxes', { signal }),
    [],
    5000,
  );
  const all = projects.data?.projects ?? [];
  const ids = new Set(all.map((p) => p.id));
  const children = new Map<string | null, Project[]>();
  for (const p of all) {
    // A project whose parent this key cannot see is shown as a root.
    const parent = p.parentId !== null && ids.has(p.parentId) ? p.parentId : null;
    children.set(parent, [...(children.get(parent) ?? []), p]);
  }
  const running = new Map<string, SandboxInfo[]>();
  for (const s of sandboxes.data?.sandboxes ?? []) {
    if (s.state === 'stopped' || s.state === 'failed') continue;
    running.set(s.projectId, [...(running.get(s.projectId) ?? []), s]);
  }
  return (
    <section>
      <h2>Projects and quotas</h2>
      <ErrorLine error={projects.error ?? sandboxes.error} />
      <ul class="tree">
        {(children.get(null) ?? []).map((p) => (
          <ProjectNode project={p} children={children} running={running} />
        ))}
      </ul>
    </section>
  );
}

/** Images and their layers: each version with the layers it stacks on. */
export function ImagesPage() {
  const images = usePoll((signal) => api<{ layers: LayerInfo[] }>('/v1/images', { signal }), [], 0);
  const layers = [...(images.data?.layers ?? [])].sort(
    (a, b) => a.name.localeCompare(b.name) || (b.createdAt ?? '').localeCompare(a.createdAt ?? ''),
  );
  const byDigest = new Map(layers.map((l) => [l.digest, l]));
  const total = layers.reduce((a, l) => a + l.sizeBytes, 0);
  return (
    <section>
      <h2>Images and layers</h2>
      <p class="muted">
        {layers.length} layers · {bytes(total)} stored
      </p>
      <ErrorLine error={images.error} />
      <table>
        <thead>
          <tr>
            <th>Image</th>
            <th>Kind</th>
            <th>Size</th>
            <th>Content</th>
            <th>Files</th>
            <th>Stacks on</th>
            <th>Digest</th>
            <th>Source</th>
          </tr>
        </thead>
        <tbody>
          {layers.map((l) => (
            <tr>
              <td class="mono">
                {l.name}:{l.version}
              </td>
              <td>
                <span class="badge">{l.kind}</span>
              </td>
              <td class="num">{bytes(l.sizeBytes)}</td>
              <td class="num">{bytes(l.contentBytes)}</td>
              <td class="num">{l.fileCount ?? '–'}</td>
              <td class="mono">
                {(l.parentDigests ?? []).map((d) => {
                  const p = byDigest.get(d);
                  return <div>{p ? `${p.name}:${p.version}` : d.slice(0, 19)}</div>;
                })}
                {!l.parentDigests && (l.parents ?? []).map((p) => <div>{p}</div>)}
              </td>
              <td class="mono muted" title={l.digest}>
                {l.digest.slice(0, 19)}
              </td>
              <td class="muted">{l.source ?? ''}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </section>
  );
}
