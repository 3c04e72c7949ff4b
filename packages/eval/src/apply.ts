import { applyFilePatch, parsePatch } from './diff.js';
import type { SandboxTools } from './tools.js';

/**
 * Applies a unified diff inside the sandbox through the agent's own tools:
 * per file a read, then a write (or a delete), exactly the calls an agent
 * editing files makes. Returns the paths it wrote or removed. Throws
 * `conflict` when a hunk does not match the file.
 */
export async function applyPatchWithTools(
  tools: SandboxTools,
  patchText: string,
): Promise<string[]> {
  const touched: string[] = [];
  for (const fp of parsePatch(patchText)) {
    const current = fp.oldPath === undefined ? undefined : await tools.readFile(fp.oldPath);
    await writeResult(tools, fp.oldPath, fp.newPath, applyFilePatch(current, fp), fp.newMode);
    touched.push(fp.newPath ?? fp.oldPath!);
  }
  return touched;
}

/**
 * Writes what a patch makes of files whose original content the caller
 * supplies (`original(path)`, from the repository at its base commit): the
 * grader's way to put test files into their base-plus-test-patch state
 * whatever the agent did to them, as SWE-bench's harness does.
 */
export async function writePatchedFiles(
  tools: SandboxTools,
  patchText: string,
  original: (path: string) => Promise<string | undefined>,
): Promise<string[]> {
  const touched: string[] = [];
  for (const fp of parsePatch(patchText)) {
    const base = fp.oldPath === undefined ? undefined : await original(fp.oldPath);
    await writeResult(tools, fp.oldPath, fp.newPath, applyFilePatch(base, fp), fp.newMode);
    touched.push(fp.newPath ?? fp.oldPath!);
  }
  return touched;
}

async function writeResult(
  tools: SandboxTools,
  oldPath: string | undefined,
  newPath: string | undefined,
  next: string | undefined,
  mode: number | undefined,
): Promise<void> {
  if (newPath === undefined || next === undefined) {
    if (oldPath !== undefined) await tools.deleteFile(oldPath);
    return;
  }
  await tools.writeFile(newPath, next, { mode });
  if (oldPath !== undefined && oldPath !== newPath) await tools.deleteFile(oldPath);
}
