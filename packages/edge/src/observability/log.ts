import { pino, type DestinationStream, type Logger } from 'pino';

export type LogLevel = 'info' | 'warn' | 'error';

/**
 * The log hook the edge and its parts call (`EdgeOptions.log`): a message,
 * structured fields, and a level. Parts that pass no level log `error` when
 * their fields carry an `err`, else `info`.
 */
export type EdgeLogFn = (msg: string, fields?: Record<string, unknown>, level?: LogLevel) => void;

/** What a log hook writes to: pino, or anything with its three methods. */
export interface LevelLogger {
  info(obj: object, msg: string): void;
  warn(obj: object, msg: string): void;
  error(obj: object, msg: string): void;
}

/**
 * Field names whose values are never written, wherever they sit (top level
 * or one object down, as pino's redaction paths allow): API keys, the edge and
 * cluster HMAC secrets, bearer headers, store credentials.
 */
export const REDACTED_FIELDS = [
  'key',
  'apiKey',
  'adminKey',
  'secret',
  'edgeSecret',
  'clusterSecret',
  'password',
  'token',
  'authorization',
  'accessKeyId',
  'secretAccessKey',
  'credentials',
] as const;

const REDACT_PATHS = [
  ...REDACTED_FIELDS,
  ...REDACTED_FIELDS.map((f) => `*.${f}`),
  'req.headers.authorization',
  'req.headers["x-dsec-signature"]',
  'headers.authorization',
];

export interface JsonLoggerOptions {
  /** The component, the `name` of every line (`dsec-edge`, `dsec-apiserver`). */
  name: string;
  /** Lowest level written. Default `info`. */
  level?: 'debug' | 'info' | 'warn' | 'error' | undefined;
  /** Where lines go. Default stdout. */
  destination?: DestinationStream | NodeJS.WritableStream | undefined;
}

/**
 * A pino logger writing one JSON object a line, with secrets redacted by
 * field name (`REDACTED_FIELDS`). Every component's logger comes from here,
 * so they share one line format and one redaction list.
 */
export function jsonLogger(options: JsonLoggerOptions): Logger {
  return pino(
    {
      name: options.name,
      level: options.level ?? 'info',
      redact: { paths: REDACT_PATHS, censor: '[redacted]' },
      // Readable UTC times: operators grep logs by date more than they parse epochs.
      timestamp: pino.stdTimeFunctions.isoTime,
    },
    options.destination,
  );
}

/**
 * Adapts a logger to the edge's log hook. An `err` field that is an Error
 * is written as its message (stack traces of expected failures, a refused
 * create, drown the lines that matter).
 */
export function edgeLog(logger: LevelLogger): EdgeLogFn {
  return (msg, fields = {}, level) => {
    const chosen = level ?? ('err' in fields ? 'error' : 'info');
    const err = fields.err;
    logger[chosen](err instanceof Error ? { ...fields, err: err.message } : fields, msg);
  };
}
