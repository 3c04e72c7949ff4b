import type { EvalTask } from '../task.js';
import type { SandboxTools } from '../tools.js';

/** Tokens an agent reports (OpenAI's `usage`, summed over turns). */
export interface TokenUsage {
  prompt: number;
  completion: number;
  total: number;
}

export interface AgentContext {
  task: EvalTask;
  /** Every action on the sandbox goes through these (request IDs, step numbers). */
  tools: SandboxTools;
  /**
   * Returns what `compute` returned the first time this task's attempt asked
   * for `key`, from the run's journal, or computes and records it. Agents put
   * their own non-repeatable decisions (a model's answer) through it, so a
   * resumed driver repeats the same tool calls with the same request IDs.
   */
  remember<T>(key: string, compute: () => Promise<T>): Promise<T>;
  signal: AbortSignal;
}

export interface AgentOutcome {
  /** The agent called `finish` (or, for scripted agents, did all it meant to). */
  finished: boolean;
  tokens?: TokenUsage | undefined;
  /** The agent's last words (a model's final message), for the result line. */
  message?: string | undefined;
}

/**
 * An agent plug-in: given a task and the sandbox's tools, it acts until it
 * is done. It must act only through `ctx.tools` (so every step has a request
 * ID) and should be deterministic given the tools' answers and what it
 * `remember`s, so that a resumed run repeats exactly the steps it took.
 */
export interface Agent {
  readonly name: string;
  run(ctx: AgentContext): Promise<AgentOutcome>;
}
