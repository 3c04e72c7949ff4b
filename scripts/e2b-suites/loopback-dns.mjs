// Preloaded (`NODE_OPTIONS=--import …`) into the vitest processes of scripts/e2b-suites.ts.
// It answers every name lookup from this process itself and never asks a DNS server:
// `localhost`, and the suite's E2B domain (DSEC_E2B_SUITES_DOMAIN) with its subdomains
// (`api.<domain>`, `<port>-<sandboxId>.<domain>`), are 127.0.0.1; any other name fails with
// ENOTFOUND. The SDK reaches DSec through the domain as it reaches E2B (https, host names), and
// a test that names a public host cannot resolve it. IP literals never reach `lookup`; the run's
// network namespace, which has only loopback, stops those.
import dns from 'node:dns';

const domain = (process.env.DSEC_E2B_SUITES_DOMAIN ?? '').toLowerCase();
if (!domain) throw new Error('loopback-dns.mjs: DSEC_E2B_SUITES_DOMAIN is not set');

/** The loopback address for a name this run serves, else undefined. */
function loopbackFor(hostname) {
  const h = String(hostname).toLowerCase().replace(/\.$/, '');
  if (h === 'localhost' || h.endsWith('.localhost')) return '127.0.0.1';
  if (h === domain || h.endsWith(`.${domain}`)) return '127.0.0.1';
  return undefined;
}

function notFound(hostname) {
  const err = new Error(`getaddrinfo ENOTFOUND ${hostname} (scripts/e2b-suites: loopback only)`);
  err.code = 'ENOTFOUND';
  err.errno = -3008;
  err.syscall = 'getaddrinfo';
  err.hostname = hostname;
  return err;
}

const original = dns.lookup;
function lookup(hostname, options, callback) {
  const cb = typeof options === 'function' ? options : callback;
  const opts = typeof options === 'object' && options !== null ? options : {};
  const address = loopbackFor(hostname);
  // IP literals are answered as the original does (no query is made for them).
  if (address === undefined && /^[0-9.]+$|:/.test(String(hostname))) {
    return original.call(dns, hostname, options, callback);
  }
  process.nextTick(() => {
    if (address === undefined) return cb(notFound(hostname));
    if (opts.all) return cb(null, [{ address, family: 4 }]);
    return cb(null, address, 4);
  });
  return {};
}
dns.lookup = lookup;
dns.promises.lookup = (hostname, options = {}) =>
  new Promise((resolve, reject) => {
    lookup(hostname, options, (err, address, family) => {
      if (err) reject(err);
      else resolve(Array.isArray(address) ? address : { address, family });
    });
  });
