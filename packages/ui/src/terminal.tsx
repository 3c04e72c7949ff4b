import { useEffect, useRef, useState } from 'preact/hooks';
import type { Terminal as XTerm } from '@xterm/xterm';
import type { FitAddon as XFitAddon } from '@xterm/addon-fit';
import { storedKey } from './api.js';

/**
 * A live shell in the sandbox: xterm.js over the API's WebSocket terminal
 * (`GET /v1/sandboxes/:id/pty`, `Upgrade: websocket`). The key goes in the
 * first message, not the URL.
 */
export function TerminalView({ id }: { id: string }) {
  const box = useRef<HTMLDivElement>(null);
  const [status, setStatus] = useState('connecting');
  useEffect(() => {
    let cleanup: (() => void) | undefined;
    let gone = false;
    // xterm.js is most of the bundle: loaded only when a terminal opens.
    void Promise.all([import('@xterm/xterm'), import('@xterm/addon-fit')]).then(
      ([{ Terminal }, { FitAddon }]) => {
        if (!gone && box.current) cleanup = start(box.current, Terminal, FitAddon);
      },
      (err: Error) => setStatus(`error: ${err.message}`),
    );
    return () => {
      gone = true;
      cleanup?.();
    };
  }, [id]);

  const start = (
    el: HTMLDivElement,
    Terminal: typeof XTerm,
    FitAddon: typeof XFitAddon,
  ): (() => void) => {
    const term = new Terminal({ convertEol: false, cursorBlink: true, fontSize: 13 });
    const fit = new FitAddon();
    term.loadAddon(fit);
    term.open(el);
    fit.fit();
    const proto = location.protocol === 'https:' ? 'wss:' : 'ws:';
    const q = new URLSearchParams({
      rows: String(term.rows),
      cols: String(term.cols),
      term: 'xterm-256color',
    });
    const ws = new WebSocket(
      `${proto}//${location.host}/v1/sandboxes/${encodeURIComponent(id)}/pty?${q}`,
    );
    ws.binaryType = 'arraybuffer';
    let ready = false;
    const encoder = new TextEncoder();
    ws.onopen = () => ws.send(JSON.stringify({ type: 'auth', key: storedKey() ?? '' }));
    ws.onmessage = (ev: MessageEvent<ArrayBuffer | string>) => {
      if (typeof ev.data !== 'string') {
        term.write(new Uint8Array(ev.data));
        return;
      }
      const msg = JSON.parse(ev.data) as {
        type: string;
        exitCode?: number;
        error?: { message: string };
      };
      if (msg.type === 'ready') {
        ready = true;
        setStatus('connected');
        term.focus();
      } else if (msg.type === 'exit') setStatus(`exited (${msg.exitCode})`);
      else if (msg.type === 'error') setStatus(`error: ${msg.error?.message ?? 'unknown'}`);
    };
    ws.onclose = () => setStatus((s) => (s === 'connected' || s === 'connecting' ? 'closed' : s));
    const input = term.onData((d) => {
      if (ready && ws.readyState === WebSocket.OPEN) ws.send(encoder.encode(d));
    });
    const resize = term.onResize(({ rows, cols }) => {
      if (ready) ws.send(JSON.stringify({ type: 'resize', rows, cols }));
    });
    const onWindow = () => fit.fit();
    addEventListener('resize', onWindow);
    return () => {
      removeEventListener('resize', onWindow);
      input.dispose();
      resize.dispose();
      ws.close();
      term.dispose();
    };
  };
  return (
    <div>
      <p class="muted" data-terminal-status={status}>
        Terminal: {status}
      </p>
      <div class="terminal" ref={box} />
    </div>
  );
}
