import { applyPatchWithTools } from '../apply.js';
import type { Agent, AgentContext, AgentOutcome } from './agent.js';

/**
 * `--agent gold`: applies the task's reference `patch` through the same tool
 * calls an agent makes (read each file, write its patched content), so a
 * correct harness scores every valid task 1. A patch that does not apply is
 * a broken task: the error reaches the result line.
 */
export class GoldAgent implements Agent {
  readonly name = 'gold';

  async run(ctx: AgentContext): Promise<AgentOutcome> {
    await applyPatchWithTools(ctx.tools, ctx.task.patch);
    return { finished: true };
  }
}

/** `--agent none`: changes nothing, so every task with a FAIL_TO_PASS test scores 0. */
export class NoneAgent implements Agent {
  readonly name = 'none';

  run(): Promise<AgentOutcome> {
    return Promise.resolve({ finished: true });
  }
}
