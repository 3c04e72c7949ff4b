import { InvalidArgumentError, type Command } from 'commander';
import type { NetworkTarget, SandboxEvent } from '@dsec/sdk';
import { contextOf } from '../context.js';
import { formatTable } from '../format.js';
import { collect, parseInteger } from '../parse.js';

interface NetworkOptions {
  allow?: string[];
  deny?: string[];
  rule?: string[];
  port?: number[];
}

interface EventsOptions {
  after?: number;
  limit?: number;
}

/** `dsec sandbox network ID …` and `dsec sandbox events ID` (issue 5). */
export function register(program: Command): void {
  const sandbox =
    program.commands.find((c) => c.name() === 'sandbox') ??
    program.command('sandbox').description('create, use and remove sandboxes');

  sandbox
    .command('network')
    .description(
      "change a running sandbox's egress policy; new connections follow within seconds.\n" +
        '--allow/--deny take a domain (example.com, *.example.com) or a CIDR (10.1.2.0/24);\n' +
        'an --allow moves a target off the deny list and back. Prints the resulting policy.',
    )
    .argument('<id>', 'sandbox ID')
    .option('--allow <target>', 'allow a domain or CIDR (repeatable)', collect)
    .option('--deny <target>', 'deny a domain or CIDR (repeatable)', collect)
    .option(
      '--rule <name=true|false>',
      'turn a named catalogue rule on or off (repeatable)',
      collect,
    )
    .option('--port <n>', 'restrict the --allow targets to these ports (repeatable)', collectPort)
    .action(async (id: string, opts: NetworkOptions, command: Command) => {
      const ctx = contextOf(command);
      const sb = ctx.client().sandbox(id);
      const info = await sb.refresh({ signal: ctx.signal });
      const ports = opts.port;
      const allowAdd = (opts.allow ?? []).map((t) => target(t, ports));
      const denyAdd = (opts.deny ?? []).map((t) => target(t, undefined));
      const key = (t: NetworkTarget) => ('domain' in t ? `d:${t.domain}` : `c:${t.cidr}`);
      const touched = new Set([...allowAdd, ...denyAdd].map(key));
      const allow = [
        ...(info.spec.networkAllow ?? []).filter((t) => !touched.has(key(t))),
        ...allowAdd,
      ];
      const deny = [
        ...(info.spec.networkDeny ?? []).filter((t) => !touched.has(key(t))),
        ...denyAdd,
      ];
      const networkRules: Record<string, boolean> = {};
      for (const r of opts.rule ?? []) {
        const m = /^([a-z0-9][a-z0-9._-]{0,63})=(true|false|on|off)$/.exec(r);
        if (!m?.[1]) throw new InvalidArgumentError(`--rule expects NAME=true|false, got ${r}`);
        networkRules[m[1]] = m[2] === 'true' || m[2] === 'on';
      }
      const updated = await sb.updateNetworkRules(
        { networkRules, allow, deny },
        { signal: ctx.signal },
      );
      const policy = {
        networkRules: updated.spec.networkRules,
        allow: updated.spec.networkAllow ?? [],
        deny: updated.spec.networkDeny ?? [],
      };
      if (ctx.json) return ctx.printJson(policy);
      const fmt = (t: NetworkTarget) =>
        ('domain' in t ? t.domain : t.cidr) + (t.ports ? `:${t.ports.join(',')}` : '');
      ctx.out(
        [
          `rules  ${
            Object.entries(policy.networkRules)
              .map(([k, v]) => `${k}=${v}`)
              .join(' ') || '-'
          }`,
          `allow  ${policy.allow.map(fmt).join(' ') || '-'}`,
          `deny   ${policy.deny.map(fmt).join(' ') || '-'}`,
        ].join('\n'),
      );
    });

  sandbox
    .command('events')
    .description(
      'audit events of a sandbox: denied connections, refused DNS names, caps and limits hit',
    )
    .argument('<id>', 'sandbox ID')
    .option('--after <id>', 'only events after this event ID', parseInteger)
    .option('--limit <n>', 'at most this many (default 500)', parseInteger)
    .action(async (id: string, opts: EventsOptions, command: Command) => {
      const ctx = contextOf(command);
      const events: SandboxEvent[] = await ctx
        .client()
        .sandbox(id)
        .events({ afterId: opts.after, limit: opts.limit, signal: ctx.signal });
      if (ctx.json) return ctx.printJson(events);
      if (events.length === 0) return ctx.out('no events');
      ctx.out(
        formatTable(
          ['ID', 'TIME', 'KIND', 'COUNT', 'MESSAGE'],
          events.map((e) => [String(e.id), e.time, e.kind, String(e.count), e.message]),
        ),
      );
    });
}

function target(s: string, ports: number[] | undefined): NetworkTarget {
  const withPorts = ports && ports.length > 0 ? { ports } : {};
  if (/^[0-9a-fA-F:.]+(\/\d{1,3})?$/.test(s) && (s.includes(':') || /^\d/.test(s)))
    return { cidr: s, ...withPorts };
  if (/^(\*\.)?[A-Za-z0-9_.-]+$/.test(s)) return { domain: s, ...withPorts };
  throw new InvalidArgumentError(`not a domain or CIDR: ${s}`);
}

function collectPort(value: string, previous: number[] = []): number[] {
  const n = Number(value);
  if (!Number.isInteger(n) || n < 1 || n > 65535)
    throw new InvalidArgumentError('ports are 1–65535');
  return [...previous, n];
}
