import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import {
  cidrContains,
  compilePolicy,
  DEFAULT_NETWORK_CATALOGUE,
  matchDomain,
  parseCidr,
} from './policy.js';

describe('network policy', () => {
  it('compiles catalogue rules, explicit domains and CIDRs; deny wins', () => {
    const p = compilePolicy(
      {
        networkRules: { pypi: true, npm: false },
        networkAllow: [{ domain: '*.Example.com.', ports: [443] }, { cidr: '10.1.2.3/24' }],
        networkDeny: [{ domain: 'bad.example.com' }],
      },
      DEFAULT_NETWORK_CATALOGUE,
    );
    assert.deepEqual(matchDomain(p, 'pypi.org'), { allowed: true, ports: [] });
    assert.deepEqual(matchDomain(p, 'FILES.pythonhosted.org.'), { allowed: true, ports: [] });
    assert.deepEqual(matchDomain(p, 'registry.npmjs.org'), { allowed: false });
    assert.deepEqual(matchDomain(p, 'a.b.example.com'), { allowed: true, ports: [443] });
    assert.deepEqual(matchDomain(p, 'example.com'), { allowed: false });
    assert.deepEqual(matchDomain(p, 'bad.example.com'), { allowed: false });
    assert.deepEqual(matchDomain(p, 'evilexample.com'), { allowed: false });
    assert.equal(p.allowCidrs[0]?.cidr.address, '10.1.2.0');
  });

  it('rejects unknown rules and malformed targets with the field', () => {
    assert.throws(
      () => compilePolicy({ networkRules: { nope: true } }, DEFAULT_NETWORK_CATALOGUE),
      {
        code: 'invalid_argument',
        field: 'networkRules.nope',
      },
    );
    assert.throws(
      () => compilePolicy({ networkRules: {}, networkAllow: [{ cidr: '10.0.0.0/33' }] }, {}),
      {
        field: 'networkAllow.0.cidr',
      },
    );
    assert.throws(
      () => compilePolicy({ networkRules: {}, networkAllow: [{ domain: 'a..b' }] }, {}),
      {
        field: 'networkAllow.0',
      },
    );
    assert.throws(
      () => compilePolicy({ networkRules: {}, networkAllow: [{ domain: 'a.b', ports: [0] }] }, {}),
      {
        field: 'networkAllow.0.ports',
      },
    );
  });

  it('handles IPv6 CIDRs', () => {
    const c = parseCidr('2001:db8::1/32', 'x');
    assert.equal(c.address, '2001:db8::');
    assert.ok(cidrContains(c, '2001:db8:ffff::1'));
    assert.ok(!cidrContains(c, '2001:db9::1'));
    assert.ok(!cidrContains(c, '10.0.0.1'));
  });
});
