"""A trainer-side RL loop over DSec rollouts (paper 6.2, 6.3).

Each training step samples a batch of tasks, hands every one to a policy
(an async callback acting on the task's sandbox through ``dsec.eval``'s
tools), collects the rewards the tests give, and turns them into
advantages for the update. On SIGTERM (the GPU job is preempted) the job's
sandboxes are paused, not lost; the next run resumes them.

    export DSEC_URL=http://127.0.0.1:7420 DSEC_API_KEY=$(cat /var/lib/dsec/admin.key)
    /usr/bin/python3 examples/python/trainer_loop.py examples/swe-tasks/tasks.jsonl \\
        --policy reference --steps 2 --batch 4

``--policy reference`` stands in for a model by applying each task's
reference patch with ``git apply`` (rewards 1); ``--policy idle`` does
nothing (rewards 0). A real trainer calls its model inside ``policy``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from dsec import DSecClient  # noqa: E402
from dsec.eval import EvalResult, EvalRunner, Rollout  # noqa: E402


async def reference_policy(rollout: Rollout) -> Dict[str, Any]:
    """Applies the task's reference patch through the rollout's tools."""
    await rollout.write_file("/tmp/policy.patch", rollout.task["patch"])
    applied = await rollout.shell("git apply /tmp/policy.patch && rm /tmp/policy.patch")
    return {"applied": applied.exit_code == 0}


async def idle_policy(rollout: Rollout) -> Dict[str, Any]:
    await rollout.shell("git status --short")
    return {}


POLICIES = {"reference": reference_policy, "idle": idle_policy}


async def train(args: argparse.Namespace) -> int:
    labels = {"job": args.job}
    preempted = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, preempted.set)
    policy = POLICIES[args.policy]
    rng = random.Random(args.seed)

    async with EvalRunner(args.tasks, labels=labels, state_dir=args.state_dir) as runner:
        await runner.prepare()
        history: List[float] = []
        for step in range(1, args.steps + 1):
            batch = rng.sample(runner.instance_ids, min(args.batch, len(runner.instance_ids)))
            rollouts = asyncio.ensure_future(runner.run_batch(policy, batch, concurrency=args.concurrency))
            stop = asyncio.ensure_future(preempted.wait())
            await asyncio.wait({rollouts, stop}, return_when=asyncio.FIRST_COMPLETED)
            if preempted.is_set():
                # Preemption: keep the rollouts' sandboxes, give their memory back.
                async with DSecClient() as client:
                    paused = await client.pause_job(labels)
                print(f"preempted: paused {len(paused.sandboxes)} sandboxes of job {args.job}")
                rollouts.cancel()
                return 143
            stop.cancel()
            results: List[EvalResult] = rollouts.result()
            rewards = [float(r.reward or 0) for r in results]
            baseline = statistics.fmean(rewards)
            history.append(baseline)
            for r, reward in zip(results, rewards):
                note = f" error={r.error['code']}" if r.error else ""
                print(
                    f"step {step} {r.instance_id:32} reward={reward:.0f} advantage={reward - baseline:+.2f}"
                    f" tools={r.tool_calls} t={r.durations.get('total', 0):.1f}s{note}"
                )
            print(f"step {step}: mean reward {baseline:.2f}")
        print(f"mean reward per step: {[round(x, 2) for x in history]}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tasks", help="task file (JSONL)")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="reference")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--job", default="trainer-demo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state-dir", default=None, help="the node's state dir (for building layers)")
    return asyncio.run(train(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
