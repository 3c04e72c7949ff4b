/**
 * Sign-in through the address: `/ui/#key=KEY` (optionally `#key=KEY&to=/sandboxes/ID`).
 * The fragment is never sent to the server, so the key stays out of access
 * logs; the page moves it into sessionStorage (gone when the tab closes) and
 * rewrites the address so it is not left in history or on screen. Pure
 * functions here; the page wires them to `location` and `sessionStorage`.
 */

/** The sessionStorage entry that holds the key. */
export const KEY_STORAGE = 'dsec.apiKey';

/** What an API key may look like: printable, no spaces (IAM decides validity). */
const KEY_SHAPE = /^[\x21-\x7e]{8,512}$/;

export interface FragmentSignIn {
  /** The key from the fragment, when it carries a plausible one. */
  key?: string;
  /** The fragment to show instead (`#/...` route), with the key removed. */
  hash: string;
}

/**
 * Reads `key=` out of a location hash. Returns the key (if any) and the
 * hash to replace it with: the `to=` route when given, else the default
 * route; a hash without `key=` is returned as it is.
 */
export function takeKeyFromFragment(hash: string, defaultRoute = '#/sandboxes'): FragmentSignIn {
  const raw = hash.startsWith('#') ? hash.slice(1) : hash;
  if (!/^key=/.test(raw)) return { hash };
  const params = new URLSearchParams(raw);
  const key = params.get('key')?.trim() ?? '';
  const to = params.get('to');
  const route = to && /^\/(?!\/)[A-Za-z0-9/_.:=~-]*$/.test(to) ? `#${to}` : defaultRoute;
  return KEY_SHAPE.test(key) ? { key, hash: route } : { hash: route };
}

/** A route in the hash: `#/sandboxes/ID` → `['sandboxes', 'ID']`. */
export function routeOf(hash: string): string[] {
  const path = hash.replace(/^#\/?/, '').split('?')[0] ?? '';
  return path
    .split('/')
    .filter((p) => p !== '')
    .map((p) => {
      try {
        return decodeURIComponent(p);
      } catch {
        return p;
      }
    });
}
