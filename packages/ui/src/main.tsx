/**
 * The DSec dashboard: a Preact single-page app served by the apiserver at
 * /ui/. Routes live in the hash (`#/sandboxes/ID`), so the server serves one
 * page; sign-in is `#key=KEY` or the form (see ./key.ts).
 */
import { render } from 'preact';
import { useEffect, useState } from 'preact/hooks';
import '@xterm/xterm/css/xterm.css';
import './style.css';
import { ApiError, api, signOut, storedKey } from './api.js';
import type { Whoami } from './api.js';
import { KEY_STORAGE, routeOf, takeKeyFromFragment } from './key.js';
import { SandboxesPage } from './sandboxes.js';
import { SandboxPage } from './sandbox.js';
import { ImagesPage, NodesPage, ProjectsPage } from './fleet.js';

function adoptFragmentKey(): void {
  const { key, hash } = takeKeyFromFragment(location.hash);
  if (hash === location.hash) return;
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  // Replace, not push: the address with the key must not stay in history.
  history.replaceState(null, '', `${location.pathname}${location.search}${hash}`);
}

function SignIn({ onDone }: { onDone: () => void }) {
  const [key, setKey] = useState('');
  const [error, setError] = useState('');
  const submit = async (e: Event) => {
    e.preventDefault();
    sessionStorage.setItem(KEY_STORAGE, key.trim());
    try {
      await api<Whoami>('/v1/whoami');
      onDone();
    } catch (err) {
      sessionStorage.removeItem(KEY_STORAGE);
      setError(
        err instanceof ApiError && err.status === 401 ? 'That key is not valid.' : String(err),
      );
    }
  };
  return (
    <form class="signin" onSubmit={(e) => void submit(e)}>
      <h1>DSec</h1>
      <label>
        API key
        <input
          type="password"
          name="key"
          autocomplete="off"
          value={key}
          onInput={(e) => setKey(e.currentTarget.value)}
          required
        />
      </label>
      <button type="submit">Sign in</button>
      {error && <p class="error">{error}</p>}
      <p class="hint">
        Or open <code>/ui/#key=KEY</code>: the key stays in this tab only.
      </p>
    </form>
  );
}

const NAV = [
  ['sandboxes', 'Sandboxes'],
  ['nodes', 'Nodes'],
  ['projects', 'Projects'],
  ['images', 'Images'],
] as const;

function App() {
  const [hash, setHash] = useState(location.hash);
  const [me, setMe] = useState<Whoami | null>(null);
  const [signedIn, setSignedIn] = useState(storedKey() !== null);
  useEffect(() => {
    const on = () => {
      adoptFragmentKey();
      setSignedIn(storedKey() !== null);
      setHash(location.hash);
    };
    addEventListener('hashchange', on);
    return () => removeEventListener('hashchange', on);
  }, []);
  useEffect(() => {
    if (!signedIn) return;
    api<Whoami>('/v1/whoami').then(setMe, (err) => {
      if (err instanceof ApiError && err.status === 401) signOut();
    });
  }, [signedIn]);
  if (!signedIn) return <SignIn onDone={() => setSignedIn(true)} />;
  const [page = 'sandboxes', id] = routeOf(hash);
  return (
    <>
      <header>
        <strong>DSec</strong>
        <nav>
          {NAV.map(([r, label]) => (
            <a href={`#/${r}`} class={page === r ? 'active' : ''}>
              {label}
            </a>
          ))}
        </nav>
        <span class="me">
          {me && `${me.projectId} · ${me.role}`}{' '}
          <button class="link" onClick={signOut}>
            Sign out
          </button>
        </span>
      </header>
      <main>
        {page === 'sandboxes' && id ? (
          <SandboxPage id={id} />
        ) : page === 'nodes' ? (
          <NodesPage />
        ) : page === 'projects' ? (
          <ProjectsPage />
        ) : page === 'images' ? (
          <ImagesPage />
        ) : (
          <SandboxesPage />
        )}
      </main>
    </>
  );
}

adoptFragmentKey();
render(<App />, document.getElementById('app')!);
