/**
 * Test support for the control database: a throwaway PostgreSQL server
 * (`startPostgres`) and the conformance suite every store runs
 * (`controlDbConformance`).
 */
export { startPostgres } from './postgres.js';
export type { PostgresServer } from './postgres.js';
export { controlDbConformance } from './conformance.js';
export type { ControlDbFixture } from './conformance.js';
