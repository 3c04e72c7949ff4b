import { DsecError } from '@dsec/core';
import { ToolError, type SandboxTools } from '../tools.js';
import type { Agent, AgentContext, AgentOutcome, TokenUsage } from './agent.js';

export interface HttpAgentOptions {
  /** An OpenAI-compatible API base (`http://127.0.0.1:8000/v1`) or its `/chat/completions` URL. */
  endpoint: string;
  model: string;
  /** Sent as `Authorization: Bearer`; default none. */
  apiKey?: string | undefined;
  /** Model turns before the agent gives up (default 30). */
  maxTurns?: number | undefined;
  /** Per model request (default 300 s). */
  requestTimeoutMs?: number | undefined;
  /** Per shell tool call (default 120 s). */
  shellTimeoutMs?: number | undefined;
  temperature?: number | undefined;
  /** Characters of a tool's answer the model sees (head and tail; default 12000). */
  maxToolOutputChars?: number | undefined;
}

/** A chat message as the chat completions API exchanges them. */
export interface ChatMessage {
  role: 'system' | 'user' | 'assistant' | 'tool';
  content: string | null;
  tool_calls?: ToolCall[] | undefined;
  tool_call_id?: string | undefined;
}

export interface ToolCall {
  id: string;
  type: 'function';
  function: { name: string; arguments: string };
}

interface Turn {
  message: ChatMessage;
  usage?: { prompt_tokens?: number; completion_tokens?: number; total_tokens?: number } | undefined;
}

/** The tools offered to the model, as chat completions `tools`. */
export const TOOL_SCHEMAS = [
  fn(
    'shell',
    'Run a shell line in the repository (state persists between calls). Returns exit code, stdout and stderr.',
    {
      command: { type: 'string', description: 'the shell line' },
    },
  ),
  fn('read_file', 'Read a text file (paths relative to the repository root).', {
    path: { type: 'string' },
  }),
  fn('write_file', 'Create or replace a file with the given content.', {
    path: { type: 'string' },
    content: { type: 'string' },
  }),
  fn(
    'edit_file',
    'Replace one exact occurrence of `old` with `new` in a file; `old` must occur exactly once.',
    {
      path: { type: 'string' },
      old: { type: 'string' },
      new: { type: 'string' },
    },
  ),
  fn('finish', 'Call when the fix is complete.', { summary: { type: 'string' } }, []),
];

const RETRIES = 3;

/**
 * `--agent http`: a tool-calling loop against an OpenAI-compatible chat
 * completions endpoint. Each model answer is recorded in the run's journal
 * before its tool calls run (`ctx.remember`), so a resumed driver replays the
 * same calls, with the same request IDs, instead of asking the model again.
 */
export class HttpAgent implements Agent {
  readonly name = 'http';
  readonly #o: HttpAgentOptions;
  readonly #url: string;

  constructor(options: HttpAgentOptions) {
    this.#o = options;
    const base = options.endpoint.replace(/\/+$/, '');
    this.#url = base.endsWith('/chat/completions') ? base : `${base}/chat/completions`;
    if (!/^https?:\/\//.test(this.#url)) {
      throw new DsecError('invalid_argument', 'the endpoint must be an http(s) URL', {
        field: 'endpoint',
      });
    }
  }

  async run(ctx: AgentContext): Promise<AgentOutcome> {
    const messages: ChatMessage[] = [
      { role: 'system', content: systemPrompt(ctx.tools.workdir) },
      { role: 'user', content: ctx.task.problem_statement },
    ];
    const tokens: TokenUsage = { prompt: 0, completion: 0, total: 0 };
    const maxTurns = this.#o.maxTurns ?? 30;
    let last: string | undefined;
    for (let turn = 1; turn <= maxTurns; turn++) {
      const reply = await ctx.remember(`turn.${turn}`, () => this.#complete(messages, ctx.signal));
      tokens.prompt += reply.usage?.prompt_tokens ?? 0;
      tokens.completion += reply.usage?.completion_tokens ?? 0;
      tokens.total +=
        reply.usage?.total_tokens ??
        (reply.usage?.prompt_tokens ?? 0) + (reply.usage?.completion_tokens ?? 0);
      const message: ChatMessage = { ...reply.message, role: 'assistant' };
      messages.push(message);
      if (typeof message.content === 'string' && message.content !== '') last = message.content;
      const calls = message.tool_calls ?? [];
      if (calls.length === 0) return { finished: false, tokens, message: last };
      for (const call of calls) {
        if (call.function.name === 'finish') {
          return { finished: true, tokens, message: summaryOf(call) ?? last };
        }
        const answer = await this.#runTool(ctx.tools, call);
        messages.push({ role: 'tool', tool_call_id: call.id, content: answer });
      }
    }
    return { finished: false, tokens, message: last };
  }

  async #runTool(tools: SandboxTools, call: ToolCall): Promise<string> {
    let args: Record<string, unknown>;
    try {
      args = JSON.parse(call.function.arguments || '{}') as Record<string, unknown>;
    } catch {
      return 'error: the arguments are not valid JSON';
    }
    const s = (k: string) => (typeof args[k] === 'string' ? args[k] : undefined);
    try {
      switch (call.function.name) {
        case 'shell': {
          const line = s('command');
          if (line === undefined) return 'error: `command` is required';
          const r = await tools.shell(line, { timeoutMs: this.#o.shellTimeoutMs });
          const note = r.outcome === 'timeout' ? ' (timed out)' : '';
          return this.#clip(
            `exit code ${r.exitCode}${note}\n--- stdout\n${r.stdout}\n--- stderr\n${r.stderr}`,
          );
        }
        case 'read_file': {
          const path = s('path');
          if (path === undefined) return 'error: `path` is required';
          const text = await tools.readFile(path);
          return text === undefined ? `error: ${path} does not exist` : this.#clip(text);
        }
        case 'write_file': {
          const path = s('path');
          const content = s('content');
          if (path === undefined || content === undefined)
            return 'error: `path` and `content` are required';
          await tools.writeFile(path, content);
          return `wrote ${Buffer.byteLength(content)} bytes to ${path}`;
        }
        case 'edit_file': {
          const path = s('path');
          const oldText = s('old');
          const newText = s('new');
          if (path === undefined || oldText === undefined || newText === undefined) {
            return 'error: `path`, `old` and `new` are required';
          }
          await tools.editFile(path, oldText, newText);
          return `edited ${path}`;
        }
        default:
          return `error: no tool named ${call.function.name}`;
      }
    } catch (err) {
      if (err instanceof ToolError) return `error: ${err.message}`;
      throw err;
    }
  }

  #clip(text: string): string {
    const max = this.#o.maxToolOutputChars ?? 12_000;
    if (text.length <= max) return text;
    const half = Math.floor(max / 2);
    return `${text.slice(0, half)}\n[… ${text.length - max} characters cut …]\n${text.slice(-half)}`;
  }

  async #complete(messages: ChatMessage[], signal: AbortSignal): Promise<Turn> {
    const body = JSON.stringify({
      model: this.#o.model,
      messages,
      tools: TOOL_SCHEMAS,
      tool_choice: 'auto',
      ...(this.#o.temperature !== undefined ? { temperature: this.#o.temperature } : {}),
    });
    let lastError: unknown;
    for (let attempt = 0; attempt <= RETRIES; attempt++) {
      if (attempt > 0) await sleep(500 * 2 ** (attempt - 1), signal);
      let res: Response;
      try {
        res = await fetch(this.#url, {
          method: 'POST',
          headers: {
            'content-type': 'application/json',
            ...(this.#o.apiKey ? { authorization: `Bearer ${this.#o.apiKey}` } : {}),
          },
          body,
          signal: AbortSignal.any([
            signal,
            AbortSignal.timeout(this.#o.requestTimeoutMs ?? 300_000),
          ]),
        });
      } catch (err) {
        if (signal.aborted)
          throw new DsecError('aborted', 'the run was interrupted', { cause: err });
        lastError = err;
        continue;
      }
      const text = await res.text();
      if (res.status === 429 || res.status >= 500) {
        lastError = new Error(`HTTP ${res.status}: ${text.slice(0, 200)}`);
        continue;
      }
      if (!res.ok) {
        throw new DsecError(
          'invalid_argument',
          `the model endpoint answered ${res.status}: ${text.slice(0, 500)}`,
          {
            field: 'endpoint',
          },
        );
      }
      const json = parseJson(text) as {
        choices?: { message?: ChatMessage }[];
        usage?: Turn['usage'];
      };
      const message = json?.choices?.[0]?.message;
      if (!message || typeof message !== 'object') {
        throw new DsecError(
          'invalid_argument',
          'the model endpoint answered without choices[0].message',
          {
            field: 'endpoint',
          },
        );
      }
      return {
        message: {
          role: 'assistant',
          content: typeof message.content === 'string' ? message.content : null,
          ...(Array.isArray(message.tool_calls) && message.tool_calls.length > 0
            ? { tool_calls: message.tool_calls }
            : {}),
        },
        usage: json.usage,
      };
    }
    throw new DsecError('unavailable', `the model endpoint failed ${RETRIES + 1} times`, {
      cause: lastError,
      details: { endpoint: this.#url },
    });
  }
}

function systemPrompt(workdir: string): string {
  return [
    `You are fixing an issue in the repository at ${workdir}, inside a sandbox.`,
    'Use the tools to inspect the code, make the change, and run tests.',
    'Paths are relative to the repository root. Call `finish` when the fix is complete.',
  ].join(' ');
}

function summaryOf(call: ToolCall): string | undefined {
  const args = parseJson(call.function.arguments) as { summary?: unknown } | undefined;
  return typeof args?.summary === 'string' ? args.summary : undefined;
}

function parseJson(text: string): unknown {
  try {
    return JSON.parse(text) as unknown;
  } catch {
    return undefined;
  }
}

function fn(
  name: string,
  description: string,
  properties: Record<string, unknown>,
  required = Object.keys(properties),
) {
  return {
    type: 'function' as const,
    function: { name, description, parameters: { type: 'object', properties, required } },
  };
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal.aborted) {
      reject(new DsecError('aborted', 'the run was interrupted'));
      return;
    }
    const t = setTimeout(resolve, ms);
    signal.addEventListener(
      'abort',
      () => {
        clearTimeout(t);
        reject(new DsecError('aborted', 'the run was interrupted'));
      },
      { once: true },
    );
  });
}
