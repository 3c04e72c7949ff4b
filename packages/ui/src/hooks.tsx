import { useEffect, useState } from 'preact/hooks';

/** Re-runs `load` every `intervalMs` (live state by polling the API), keeps the last answer. */
export function usePoll<T>(
  load: (signal: AbortSignal) => Promise<T>,
  deps: unknown[],
  intervalMs = 2000,
): { data?: T; error?: Error; reload: () => void } {
  const [state, setState] = useState<{ data?: T; error?: Error }>({});
  const [tick, setTick] = useState(0);
  useEffect(() => {
    const ac = new AbortController();
    let timer: ReturnType<typeof setTimeout> | undefined;
    const run = async () => {
      try {
        const data = await load(ac.signal);
        if (!ac.signal.aborted) setState({ data });
      } catch (err) {
        if (!ac.signal.aborted) setState((s) => ({ data: s.data, error: err as Error }));
      }
      // Background tabs need no live view.
      if (!ac.signal.aborted && intervalMs > 0) timer = setTimeout(() => void run(), intervalMs);
    };
    void run();
    return () => {
      ac.abort();
      clearTimeout(timer);
    };
  }, [...deps, tick]);
  return { ...state, reload: () => setTick((t) => t + 1) };
}

export function ErrorLine({ error }: { error?: Error | undefined }) {
  return error ? (
    <p class="error" role="alert">
      {error.message}
    </p>
  ) : null;
}
