import type Database from 'better-sqlite3';

/**
 * Prepares each distinct SQL text once and reuses the statement, so requests
 * stay off SQLite's compiler.
 */
export function statementCache(db: Database.Database): (source: string) => Database.Statement {
  const statements = new Map<string, Database.Statement>();
  return (source) => {
    let statement = statements.get(source);
    if (!statement) {
      statement = db.prepare(source);
      statements.set(source, statement);
    }
    return statement;
  };
}
