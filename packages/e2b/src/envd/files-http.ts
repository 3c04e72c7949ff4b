import { posix } from 'node:path';
import type { Readable } from 'node:stream';
import { createGunzip } from 'node:zlib';
import busboy from 'busboy';
import type { FastifyReply, FastifyRequest } from 'fastify';
import { DsecError, toDsecError } from '@dsec/core';
import { checkUser } from '../auth.js';
import type { OpenedSandbox, SandboxAccess } from '../sandbox-access.js';
import { uploadMetadata } from './metadata.js';
import { ensureParents } from './sandbox-files.js';

/**
 * envd's HTTP file transfer: `GET /files` streams a file out, `POST /files`
 * writes one (raw body) or several (multipart, each part's file name its
 * path) and answers their entries. Parent directories are made, owned by
 * the user, and `X-Metadata-*` headers are kept as the files' metadata, as
 * envd does. Signed URLs (`signature=`) are not accepted: every call
 * carries the key (docs/e2b.md).
 */

/** Parts one multipart upload may carry. */
const MAX_UPLOAD_PARTS = 1000;

interface WrittenEntry {
  name: string;
  type: 'file';
  path: string;
  metadata?: Record<string, string> | undefined;
}

function queryOf(req: FastifyRequest): { path: string; user: string | undefined } {
  const q = req.query as Record<string, unknown>;
  const path = typeof q.path === 'string' ? q.path : '';
  const user = checkUser(typeof q.username === 'string' ? q.username : undefined);
  return { path, user };
}

export async function downloadFile(
  access: SandboxAccess,
  sb: OpenedSandbox,
  req: FastifyRequest,
  reply: FastifyReply,
  signal: AbortSignal,
): Promise<void> {
  const q = queryOf(req);
  const path = await access.resolvePath(sb, q.path, q.user, signal);
  const body = await sb.io.readFile(sb.id, path, { user: q.user, signal });
  await reply
    .header('content-type', 'application/octet-stream')
    .header('cache-control', 'no-store')
    .send(body);
}

export async function uploadFiles(
  access: SandboxAccess,
  sb: OpenedSandbox,
  req: FastifyRequest,
  signal: AbortSignal,
): Promise<WrittenEntry[]> {
  // Checked before anything is written: bad metadata fails the whole upload.
  const metadata = uploadMetadata(req.headers, req.raw.rawHeaders);
  const q = queryOf(req);
  const type = (req.headers['content-type'] ?? '').toLowerCase();
  const write = async (target: string, body: Readable): Promise<WrittenEntry> => {
    const path = await access.resolvePath(sb, target, q.user, signal);
    if (path === '/')
      throw new DsecError('invalid_argument', 'path is required', { field: 'path' });
    await ensureParents(access, sb, posix.dirname(path), q.user, signal);
    const info = await sb.io.writeFile(sb.id, path, body, { user: q.user, signal });
    // A write replaces the file (a new inode), so it has no metadata but this upload's.
    if (metadata && Object.keys(metadata).length > 0) {
      await access.metadata.set(sb, info.path, metadata, q.user, signal);
      return { name: info.name, type: 'file', path: info.path, metadata };
    }
    return { name: info.name, type: 'file', path: info.path };
  };
  if (type.startsWith('multipart/form-data')) {
    return writeParts(req, (filename, body) => write(filename || q.path, body));
  }
  if (!q.path) throw new DsecError('invalid_argument', 'path is required', { field: 'path' });
  const raw = req.raw as Readable;
  const gzip = (req.headers['content-encoding'] ?? '').toLowerCase() === 'gzip';
  return [await write(q.path, gzip ? raw.pipe(createGunzip()) : raw)];
}

/** Writes each file part in turn (busboy hands over the next part once this one is read). */
function writeParts(
  req: FastifyRequest,
  write: (filename: string, body: Readable) => Promise<WrittenEntry>,
): Promise<WrittenEntry[]> {
  return new Promise((resolve, reject) => {
    let parser: busboy.Busboy;
    try {
      parser = busboy({
        headers: req.headers,
        // A part's file name is its path in the sandbox: keep directories, decode UTF-8.
        preservePath: true,
        defParamCharset: 'utf8',
        limits: { files: MAX_UPLOAD_PARTS, fields: 100 },
      });
    } catch (err) {
      reject(new DsecError('invalid_argument', `malformed multipart upload: ${String(err)}`));
      return;
    }
    const written: WrittenEntry[] = [];
    let failure: unknown;
    let chain = Promise.resolve();
    parser.on('file', (_field, stream, info) => {
      chain = chain.then(async () => {
        if (failure !== undefined) {
          stream.resume();
          return;
        }
        try {
          written.push(await write(info.filename ?? '', stream));
        } catch (err) {
          failure = err;
          stream.resume();
        }
      });
    });
    parser.on('filesLimit', () => {
      failure ??= new DsecError('invalid_argument', `at most ${MAX_UPLOAD_PARTS} files per upload`);
    });
    parser.on('error', (err) => {
      failure ??= new DsecError('invalid_argument', `malformed multipart upload: ${String(err)}`);
      void chain.then(() => reject(toDsecError(failure)));
    });
    parser.on('close', () => {
      void chain.then(() => {
        if (failure !== undefined) reject(toDsecError(failure));
        else if (written.length === 0) {
          reject(
            new DsecError('invalid_argument', 'the upload carries no file', { field: 'file' }),
          );
        } else resolve(written);
      });
    });
    (req.raw as Readable).pipe(parser);
  });
}
