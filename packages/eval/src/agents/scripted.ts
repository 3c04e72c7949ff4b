import { DsecError } from '@dsec/core';
import { applyPatchWithTools } from '../apply.js';
import { isSwebenchTask } from '../swebench/dataset.js';
import type { SandboxTools } from '../tools.js';
import type { Agent, AgentContext, AgentOutcome } from './agent.js';

/** A binary hunk, which only `git apply` (in the sandbox) takes. */
const BINARY_HUNK = /^(GIT binary patch|Binary files .* differ)$/m;
const APPLY_TIMEOUT_MS = 300_000;

/**
 * Applies a patch in the sandbox's repository as SWE-bench's harness
 * applies one: `git apply -v`, then `git apply -v --reject`, then
 * `patch --batch --fuzz=5 -p1`; the patch on stdin (at most 1 MiB).
 * `conflict` (reason `patch_does_not_apply`) when none takes it.
 */
export async function gitApplyInSandbox(tools: SandboxTools, patch: string): Promise<void> {
  const r = await tools.exec(
    'f=$(mktemp) && cat > "$f" && { git apply -v "$f" || git apply -v --reject "$f" || patch --batch --fuzz=5 -p1 -i "$f"; }; rc=$?; rm -f "$f"; exit $rc',
    { timeoutMs: APPLY_TIMEOUT_MS, stdin: patch, maxOutputBytes: 256 * 1024 },
  );
  if (r.exitCode !== 0) {
    throw new DsecError(
      'conflict',
      `the patch does not apply: ${`${r.stdout}\n${r.stderr}`.trim().slice(-800)}`,
      { field: 'patch', details: { reason: 'patch_does_not_apply' } },
    );
  }
}

/**
 * `--agent gold`: applies the task's reference `patch` through the same tool
 * calls an agent makes (read each file, write its patched content), so a
 * correct harness scores every valid task 1. A patch that does not apply is
 * a broken task: the error reaches the result line. A SWE-bench instance's
 * patch, and any patch with a binary hunk, is applied with `git apply` in
 * the sandbox instead (`gitApplyInSandbox`), as SWE-bench applies it.
 */
export class GoldAgent implements Agent {
  readonly name = 'gold';

  async run(ctx: AgentContext): Promise<AgentOutcome> {
    if (isSwebenchTask(ctx.task) || BINARY_HUNK.test(ctx.task.patch)) {
      await gitApplyInSandbox(ctx.tools, ctx.task.patch);
    } else {
      await applyPatchWithTools(ctx.tools, ctx.task.patch);
    }
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
