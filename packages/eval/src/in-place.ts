import { DsecError } from '@dsec/core';
import type { SandboxTools } from './tools.js';

/**
 * Kills every process in the sandbox but its init, from inside, as root (uid
 * 0 by number: the agent may have rewritten /etc/passwd), with the
 * platform's own shell. `kill -STOP -1` stops every process of the
 * sandbox's pid namespace except this shell and init in one pass of the
 * kernel's task list, and a process forking at that moment passes the stop
 * to its child (a signal to -1 is a group signal), so nothing can respawn or
 * slip out; SIGSTOP cannot be caught, ignored or blocked. The command's own
 * reaper (the shell's parent, a platform process) is continued at once; then
 * every other process is SIGKILLed and the scan repeats until none is left
 * (zombies wait for init). Builtins only in the loop, so the shell forks
 * nothing the scan would see. The state is read from /proc/PID/status,
 * where the name is escaped (in /proc/PID/stat a name with a newline, which
 * PR_SET_NAME allows, can put a forged state on the first line). A zombie is
 * passed over unless it is a thread-group leader whose other threads live on
 * (its main thread exited alone): SIGKILL to its pid ends them. Prints
 * `killed N left M`; exits 1 when
 * something outlived two seconds of rounds (a process stuck in the kernel).
 * The platform's chronus daemon is outside the sandbox's pid namespace and
 * is not touched; the session shells and idle reapers it kept are killed
 * and replaced on the next command.
 */
export const KILL_LEFTOVERS_SCRIPT = `kill -STOP -1 2>/dev/null
me=$$
reaper=$PPID
kill -CONT "$reaper" 2>/dev/null
killed=0
round=0
while :; do
  left=0
  for d in /proc/[0-9]*; do
    p=\${d#/proc/}
    if [ "$p" = 1 ] || [ "$p" = "$me" ] || [ "$p" = "$reaper" ]; then continue; fi
    st=
    { while IFS= read -r l; do
        case $l in State:*) st=\${l#State:}; break ;; esac
      done < "$d/status"; } 2>/dev/null
    set -- $st
    [ "$#" = 0 ] && continue
    if [ "$1" = Z ] || [ "$1" = X ]; then
      set -- "$d"/task/*
      [ "$#" -le 1 ] && continue
    fi
    kill -KILL "$p" 2>/dev/null && [ "$round" = 0 ] && killed=$((killed + 1))
    left=$((left + 1))
  done
  [ "$left" = 0 ] && break
  round=$((round + 1))
  [ "$round" -ge 200 ] && break
  usleep 10000
done
echo "killed $killed left $left"
[ "$left" = 0 ]`;

const KILL_TIMEOUT_MS = 30_000;

/**
 * Kills the agent's leftovers (KILL_LEFTOVERS_SCRIPT); returns how many
 * processes it killed. Throws `internal` when one survives: grading in place
 * would then not be sound.
 */
export async function killLeftovers(tools: SandboxTools): Promise<number> {
  const r = await tools.exec(KILL_LEFTOVERS_SCRIPT, { timeoutMs: KILL_TIMEOUT_MS, user: '0' });
  const words = r.stdout.trim().split(' ');
  const killed = words[0] === 'killed' ? Number(words[1]) : NaN;
  if (r.exitCode !== 0 || !Number.isInteger(killed)) {
    throw new DsecError(
      'internal',
      `the agent's processes could not all be killed before grading in place: ${r.stdout.trim()} ${r.stderr.trim()}`.trim(),
    );
  }
  return killed;
}
