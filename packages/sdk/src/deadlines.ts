/** The server's default command timeout (docs/CONVENTIONS.md, `CommandBody`). */
export { DEFAULT_COMMAND_TIMEOUT_MS } from '@dsec/core';
/** Slack on top of the command timeout before the client gives up on the answer. */
export const COMMAND_DEADLINE_SLACK_MS = 30_000;
