import type fc from 'fast-check';

/**
 * fast-check arbitraries from the JSON schemas of the OpenAPI document: a
 * value the schema accepts (`valid`), and one it should refuse (`invalid`:
 * a wrong type, a value past a bound, a required field left out, an unknown
 * field, hostile strings). Only what the API's document uses is covered:
 * `$ref`, `type` (one or a list), `enum`, `const`, `anyOf`/`oneOf`/`allOf`,
 * object `properties`/`required`/`additionalProperties`, array `items` and
 * bounds, number and string bounds, and `pattern` (fast-check generates
 * strings matching it). Sizes are capped so a run stays fast.
 *
 * `hint(name)` lets the caller mix its own values into named fields (IDs of
 * the fuzz run's resources, so bodies name real sandboxes and projects).
 */

export interface JsonSchema {
  $ref?: string;
  type?: string | string[];
  enum?: unknown[];
  const?: unknown;
  anyOf?: JsonSchema[];
  oneOf?: JsonSchema[];
  allOf?: JsonSchema[];
  properties?: Record<string, JsonSchema>;
  required?: string[];
  additionalProperties?: boolean | JsonSchema;
  items?: JsonSchema;
  minItems?: number;
  maxItems?: number;
  minimum?: number;
  maximum?: number;
  exclusiveMinimum?: number;
  exclusiveMaximum?: number;
  minLength?: number;
  maxLength?: number;
  pattern?: string;
  nullable?: boolean;
  default?: unknown;
}

export interface SchemaContext {
  fc: typeof fc;
  /** `#/components/schemas/Name` → its schema. */
  resolve: (ref: string) => JsonSchema;
  /** Values to mix into a field of this name (and into the items of an array field). */
  hint: (name: string) => fc.Arbitrary<unknown> | undefined;
}

/** Longest string or array generated for an unbounded (or very large) schema. */
const MAX_GENERATED = 24;

/** Strings that break naive validators and the code behind them. */
export const HOSTILE_STRINGS = [
  '',
  ' ',
  '\u0000',
  'a\u0000b',
  '../../../etc/passwd',
  '..',
  '/',
  '%2e%2e%2f',
  '\r\nX-Injected: 1',
  '${jndi:ldap://x}',
  '<script>',
  "'; DROP TABLE projects; --",
  '\u202e\u0645\u{1f4a5}',
  '\ud800',
  'null',
  '__proto__',
  'constructor',
  '-1',
  '1e999',
  'x'.repeat(300),
  'é'.repeat(5000),
];

const HOSTILE_NUMBERS = [
  -1,
  0,
  1,
  -0,
  0.5,
  2 ** 31,
  2 ** 53,
  -(2 ** 53),
  Number.MAX_VALUE,
  -Number.MAX_VALUE,
  1e-300,
];

export class SchemaArbitraries {
  constructor(private readonly ctx: SchemaContext) {}

  #deref(schema: JsonSchema): JsonSchema {
    let s = schema;
    for (let depth = 0; s.$ref !== undefined && depth < 16; depth++) s = this.ctx.resolve(s.$ref);
    if (s.allOf) {
      // The document's allOf only adds fields to one object: merge them.
      const merged: JsonSchema = { type: 'object', properties: {}, required: [] };
      for (const part of s.allOf.map((p) => this.#deref(p))) {
        Object.assign(merged.properties!, part.properties);
        merged.required!.push(...(part.required ?? []));
        if (part.additionalProperties !== undefined)
          merged.additionalProperties = part.additionalProperties;
      }
      return merged;
    }
    return s;
  }

  /** A value the schema accepts (as far as its keywords say). */
  valid(schema: JsonSchema, name = ''): fc.Arbitrary<unknown> {
    const { fc } = this.ctx;
    const s = this.#deref(schema);
    const hinted = this.ctx.hint(name);
    const own = this.#validOwn(s, name);
    return hinted ? fc.oneof({ weight: 1, arbitrary: hinted }, { weight: 2, arbitrary: own }) : own;
  }

  #validOwn(s: JsonSchema, name: string): fc.Arbitrary<unknown> {
    const { fc } = this.ctx;
    if (s.const !== undefined) return fc.constant(s.const);
    if (s.enum) return fc.constantFrom(...s.enum);
    const alternatives = s.anyOf ?? s.oneOf;
    if (alternatives) return fc.oneof(...alternatives.map((a) => this.valid(a, name)));
    const types = Array.isArray(s.type) ? s.type : s.type ? [s.type] : [];
    if (types.length > 1)
      return fc.oneof(...types.map((t) => this.#validOwn({ ...s, type: t }, name)));
    switch (types[0]) {
      case 'string':
        return this.#string(s);
      case 'integer':
        return fc.integer({ min: intBound(s, 'min'), max: intBound(s, 'max') });
      case 'number':
        return fc.double({
          min: s.minimum ?? s.exclusiveMinimum ?? -1e9,
          max: s.maximum ?? s.exclusiveMaximum ?? 1e9,
          noNaN: true,
          noDefaultInfinity: true,
          minExcluded: s.exclusiveMinimum !== undefined,
          maxExcluded: s.exclusiveMaximum !== undefined,
        });
      case 'boolean':
        return fc.boolean();
      case 'null':
        return fc.constant(null);
      case 'array':
        return fc.array(this.valid(s.items ?? {}, name), {
          minLength: s.minItems ?? 0,
          maxLength: Math.max(s.minItems ?? 0, Math.min(s.maxItems ?? MAX_GENERATED, 4)),
        });
      case 'object':
        return this.#object(s);
      default:
        return fc.jsonValue({ maxDepth: 2 });
    }
  }

  #string(s: JsonSchema): fc.Arbitrary<string> {
    const { fc } = this.ctx;
    const maxLength = Math.min(s.maxLength ?? MAX_GENERATED, MAX_GENERATED);
    const minLength = Math.min(s.minLength ?? 0, maxLength);
    if (s.pattern !== undefined) {
      const re = new RegExp(s.pattern);
      return fc
        .stringMatching(re)
        .filter(
          (v) => v.length >= (s.minLength ?? 0) && v.length <= (s.maxLength ?? Number.MAX_VALUE),
        );
    }
    return fc.string({ minLength, maxLength });
  }

  #object(s: JsonSchema): fc.Arbitrary<Record<string, unknown>> {
    const { fc } = this.ctx;
    const props = s.properties ?? {};
    const required = new Set(s.required ?? []);
    const model: Record<string, fc.Arbitrary<unknown>> = {};
    for (const [k, v] of Object.entries(props)) model[k] = this.valid(v, k);
    const known = fc.record(model, {
      requiredKeys: [...required].filter((k) => k in props),
    }) as fc.Arbitrary<Record<string, unknown>>;
    const extra = s.additionalProperties;
    if (extra && typeof extra === 'object' && Object.keys(props).length === 0) {
      return fc.dictionary(fc.string({ minLength: 1, maxLength: 12 }), this.valid(extra), {
        maxKeys: 4,
      });
    }
    return known;
  }

  /** A value the schema should refuse, or one at its edges (for the server to refuse cleanly). */
  invalid(schema: JsonSchema, name = ''): fc.Arbitrary<unknown> {
    const { fc } = this.ctx;
    const s = this.#deref(schema);
    const hostile = fc.oneof(
      fc.constantFrom<unknown>(...HOSTILE_STRINGS, ...HOSTILE_NUMBERS, null, true, [], {}),
      fc.jsonValue({ maxDepth: 3 }),
      deepNesting(fc),
    );
    const types = Array.isArray(s.type) ? s.type : s.type ? [s.type] : [];
    if (types.includes('object') || s.properties) {
      const props = Object.keys(s.properties ?? {});
      const base = this.#object(s);
      const variants: fc.Arbitrary<unknown>[] = [hostile];
      variants.push(
        base.chain((o) =>
          fc
            .constantFrom(
              '__proto__',
              'constructor',
              'privileged',
              'hostPid',
              'edgeId',
              'x'.repeat(200),
            )
            .map((k) => Object.assign(Object.create(null) as object, o, { [k]: 1 })),
        ),
      );
      if (props.length > 0) {
        variants.push(
          fc
            .tuple(base, fc.constantFrom(...props))
            .chain(([o, k]) =>
              this.invalid(s.properties![k]!, k).map((bad) => ({ ...o, [k]: bad })),
            ),
        );
        const required = s.required ?? [];
        if (required.length > 0)
          variants.push(
            fc.tuple(base, fc.constantFrom(...required)).map(([o, k]) => {
              const copy = { ...o };
              delete copy[k];
              return copy;
            }),
          );
      }
      return fc.oneof(...variants);
    }
    if (types.includes('array')) {
      return fc.oneof(
        hostile,
        fc.array(this.invalid(s.items ?? {}, name), { minLength: 1, maxLength: 3 }),
        fc.constant(Array.from({ length: (s.maxItems ?? 64) + 1 }, () => 0)),
      );
    }
    if (types.includes('integer') || types.includes('number')) {
      const edges: number[] = [];
      for (const b of [s.minimum, s.maximum, s.exclusiveMinimum, s.exclusiveMaximum])
        if (b !== undefined) edges.push(b - 1, b, b + 1, b + 0.5);
      return fc.oneof(hostile, fc.constantFrom(...edges, ...HOSTILE_NUMBERS));
    }
    if (types.includes('string')) {
      const max = s.maxLength;
      return fc.oneof(
        hostile,
        fc.constant(max !== undefined ? 'a'.repeat(max + 1) : 'a'.repeat(70_000)),
        fc.string({ unit: 'binary', maxLength: 40 }),
      );
    }
    return hostile;
  }
}

function intBound(s: JsonSchema, side: 'min' | 'max'): number {
  const v =
    side === 'min'
      ? (s.minimum ?? (s.exclusiveMinimum !== undefined ? s.exclusiveMinimum + 1 : -1e6))
      : (s.maximum ?? (s.exclusiveMaximum !== undefined ? s.exclusiveMaximum - 1 : 1e6));
  return Math.max(Number.MIN_SAFE_INTEGER, Math.min(Number.MAX_SAFE_INTEGER, Math.round(v)));
}

/** JSON nested far deeper than any schema, as a parser's stack sees it. */
function deepNesting(f: typeof fc): fc.Arbitrary<unknown> {
  return f.integer({ min: 50, max: 2000 }).map((depth) => {
    let v: unknown = 1;
    for (let i = 0; i < depth; i++) v = i % 2 ? { a: v } : [v];
    return v;
  });
}
