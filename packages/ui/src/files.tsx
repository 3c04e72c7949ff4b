import { useState } from 'preact/hooks';
import { api, enc } from './api.js';
import type { FileInfo } from './api.js';
import { bytes } from './format.js';
import { ErrorLine, usePoll } from './hooks.js';

/** Files shown inline up to this size; larger ones are offered as downloads only. */
const PREVIEW_BYTES = 256 * 1024;

function parentOf(path: string): string {
  const i = path.replace(/\/+$/, '').lastIndexOf('/');
  return i <= 0 ? '/' : path.slice(0, i);
}

export function FileBrowser({ id }: { id: string }) {
  const [dir, setDir] = useState('/');
  const [open, setOpen] = useState<{ path: string; text?: string; error?: Error }>();
  const list = usePoll(
    (signal) =>
      api<{ entries: FileInfo[] }>(`/v1/sandboxes/${enc(id)}/files/list?path=${enc(dir)}`, {
        signal,
      }),
    [id, dir],
    0,
  );
  const entries = [...(list.data?.entries ?? [])].sort(
    (a, b) =>
      Number(b.type === 'directory') - Number(a.type === 'directory') ||
      a.name.localeCompare(b.name),
  );
  const fetchFile = (path: string) =>
    api<ArrayBuffer>(`/v1/sandboxes/${enc(id)}/files?path=${enc(path)}`, { raw: true });
  const view = async (f: FileInfo) => {
    if (f.size > PREVIEW_BYTES) {
      setOpen({
        path: f.path,
        error: new Error(`${bytes(f.size)}: too large to preview; download it`),
      });
      return;
    }
    try {
      setOpen({ path: f.path, text: new TextDecoder().decode(await fetchFile(f.path)) });
    } catch (err) {
      setOpen({ path: f.path, error: err as Error });
    }
  };
  const download = async (f: FileInfo) => {
    const url = URL.createObjectURL(new Blob([await fetchFile(f.path)]));
    const a = document.createElement('a');
    a.href = url;
    a.download = f.name;
    a.click();
    URL.revokeObjectURL(url);
  };
  return (
    <div class="files">
      <div class="toolbar">
        <code>{dir}</code>
        {dir !== '/' && <button onClick={() => setDir(parentOf(dir))}>Up</button>}
        <button onClick={list.reload}>Refresh</button>
      </div>
      <ErrorLine error={list.error} />
      <table>
        <tbody>
          {entries.map((f) => (
            <tr>
              <td>
                {f.type === 'directory' ? (
                  <button class="link" onClick={() => setDir(f.path)}>
                    {f.name}/
                  </button>
                ) : f.type === 'file' ? (
                  <button class="link" onClick={() => void view(f)}>
                    {f.name}
                  </button>
                ) : (
                  <span>
                    {f.name}
                    {f.target ? ` → ${f.target}` : ''}
                  </span>
                )}
              </td>
              <td class="muted">{f.type}</td>
              <td class="num">{f.type === 'file' ? bytes(f.size) : ''}</td>
              <td class="mono muted">{(f.mode & 0o7777).toString(8)}</td>
              <td>
                {f.type === 'file' && (
                  <button class="small" onClick={() => void download(f)}>
                    Download
                  </button>
                )}
              </td>
            </tr>
          ))}
        </tbody>
      </table>
      {open && (
        <div class="preview">
          <strong class="mono">{open.path}</strong>
          <ErrorLine error={open.error} />
          {open.text !== undefined && <pre>{open.text}</pre>}
        </div>
      )}
    </div>
  );
}
