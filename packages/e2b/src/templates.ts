import { DsecError, parseLayerRef } from '@dsec/core';

/**
 * E2B templates as DSec images. An E2B template names what a sandbox starts
 * from; in DSec that is a base image, optionally a workspace layer above it
 * and toolkit layers above that. A template string spells all three:
 *
 *   `image[:version][/workspace[:version]][+toolkit[:version]]…`
 *
 * e.g. `python:3.12`, `python/swe-task-17`, `python/swe-task-17+git+uv`.
 * Operators may also define names (`base`, `code-interpreter-v1`) as either
 * such a string or a partial DSec create body (image, limits, network,
 * user…), so unmodified E2B code that asks for a named template runs here.
 */

/** A partial `POST /v1/sandboxes` body (docs/CONVENTIONS.md); the DSec schema validates it. */
export type E2bTemplateBody = Record<string, unknown> & { image: string };

/** Template names an operator defines: a template string or a partial create body. */
export type E2bTemplates = Record<string, string | E2bTemplateBody>;

/** Parses a template string into the layer fields of a create body. */
export function parseTemplateString(template: string): {
  image: string;
  workspace?: string;
  toolkits: string[];
} {
  const [stack = '', ...toolkits] = template.split('+');
  const slash = stack.indexOf('/');
  const image = slash < 0 ? stack : stack.slice(0, slash);
  const workspace = slash < 0 ? undefined : stack.slice(slash + 1);
  for (const [ref, what] of [
    [image, 'image'],
    ...(workspace !== undefined ? [[workspace, 'workspace']] : []),
    ...toolkits.map((t) => [t, 'toolkit']),
  ] as [string, string][]) {
    if (parseLayerRef(ref) === undefined) {
      throw new DsecError(
        'invalid_argument',
        `template ${JSON.stringify(template.slice(0, 300))}: ${what} ${JSON.stringify(ref.slice(0, 130))} is not a layer name (name or name:version)`,
        { field: 'templateID' },
      );
    }
  }
  return { image, ...(workspace !== undefined ? { workspace } : {}), toolkits };
}

/**
 * The create-body fields a template stands for: an operator-defined name
 * first, else the template string itself.
 */
export function resolveTemplate(template: string, defined: E2bTemplates = {}): E2bTemplateBody {
  const own = Object.hasOwn(defined, template) ? defined[template] : undefined;
  if (own === undefined) return parseTemplateString(template);
  if (typeof own === 'string') return parseTemplateString(own);
  return { ...own };
}
