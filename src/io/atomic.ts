/**
 * Atomic file replacement: readers (a trainer polling a directory, a resumed run) see either the old file or the
 * complete new one under the final name, never a prefix of it, even if the process dies mid-write.
 *
 * Synchronous on purpose: a caller that forgot to await an async writer would publish a manifest before the
 * files it lists exist, and lose write errors to unhandled rejections.
 */
import { randomBytes } from 'node:crypto';
import { closeSync, fsyncSync, openSync, renameSync, unlinkSync, writevSync } from 'node:fs';
import { dirname } from 'node:path';
import { argError, TreepackError } from '../errors.js';

export type AtomicData = string | ArrayBufferView | Iterable<ArrayBufferView>;

/**
 * Pending chunks are flushed with one writev once they hold this many bytes or IOV_MAX buffers: large enough
 * that an in-memory payload goes out in a few syscalls, small enough that a streaming producer (a generator) is
 * not buffered whole.
 */
const FLUSH_BYTES = 16 << 20;
const FLUSH_BUFFERS = 1024;

/**
 * Wraps a failed fs call as E_IO naming the path, with what was being done and the system's reason
 * ("cannot create the output directory: EROFS: read-only file system"); anything else (a producer's own error, a
 * TreepackError) passes unchanged.
 */
export function ioError(err: unknown, file: string, action?: string): unknown {
  if (err instanceof TreepackError) return err;
  if (err instanceof Error && typeof (err as NodeJS.ErrnoException).syscall === 'string') {
    // Node's message is "CODE: description, syscall 'path'": the path is already in `file`.
    const reason = /^[A-Z0-9_]+: [^,]*/.exec(err.message)?.[0] ?? err.message;
    const e = new TreepackError('E_IO', action ? `cannot ${action}: ${reason}` : reason, { file });
    e.cause = err;
    return e;
  }
  return err;
}

function asBytes(chunk: unknown, index: number): Uint8Array {
  if (!ArrayBuffer.isView(chunk)) throw argError(`chunk ${index}`, 'an ArrayBufferView', chunk);
  return new Uint8Array(chunk.buffer, chunk.byteOffset, chunk.byteLength);
}

/** Writes every byte of `bufs` at the file position: a writev may stop short (2 GiB per call on Linux). */
export function writeAll(fd: number, bufs: Uint8Array[]): void {
  let rest = bufs.filter((b) => b.byteLength > 0);
  while (rest.length > 0) {
    let written = writevSync(fd, rest);
    if (written <= 0) throw new TreepackError('E_IO', 'writev wrote no bytes');
    let k = 0;
    while (k < rest.length && written >= rest[k].byteLength) written -= rest[k++].byteLength;
    rest = rest.slice(k);
    if (written > 0) rest[0] = rest[0].subarray(written);
  }
}

function chunksOf(data: AtomicData): Iterable<ArrayBufferView> {
  if (typeof data === 'string') return [Buffer.from(data, 'utf8')];
  if (ArrayBuffer.isView(data)) return [data];
  return data;
}

/**
 * Writes `data` to `path + '.tmp-<pid>-<random>'` in the same directory, fsyncs it, renames it over `path` and
 * fsyncs the directory so the rename itself survives a power loss. On any failure the temp file is removed and
 * the error rethrown (fs failures as E_IO naming `path`); `path` keeps its previous content.
 */
export function writeFileAtomic(path: string, data: AtomicData): void {
  const tmp = `${path}.tmp-${process.pid}-${randomBytes(6).toString('hex')}`;
  // Only a temp file this call created is ever removed, and none once it has become `path`.
  let ownsTmp = false;
  try {
    const fd = openSync(tmp, 'wx');
    ownsTmp = true;
    try {
      let pending: Uint8Array[] = [];
      let pendingBytes = 0;
      let index = 0;
      for (const chunk of chunksOf(data)) {
        const bytes = asBytes(chunk, index++);
        pending.push(bytes);
        pendingBytes += bytes.byteLength;
        if (pendingBytes >= FLUSH_BYTES || pending.length >= FLUSH_BUFFERS) {
          writeAll(fd, pending);
          pending = [];
          pendingBytes = 0;
        }
      }
      writeAll(fd, pending);
      fsyncSync(fd);
    } finally {
      closeSync(fd);
    }
    renameSync(tmp, path);
    ownsTmp = false;
    syncDirectory(dirname(path));
  } catch (err) {
    if (ownsTmp) {
      try {
        unlinkSync(tmp);
      } catch {
        // The original failure is the one worth reporting.
      }
    }
    throw ioError(err, path);
  }
}

/**
 * Some platforms cannot open or fsync a directory (Windows: EISDIR/EPERM; some filesystems: EINVAL). There the
 * rename is as durable as the platform allows, so only those refusals are ignored.
 */
export function syncDirectory(dir: string): void {
  let fd: number | undefined;
  try {
    fd = openSync(dir, 'r');
    fsyncSync(fd);
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    if (code !== 'EISDIR' && code !== 'EPERM' && code !== 'EINVAL' && code !== 'ENOTSUP') throw err;
  } finally {
    if (fd !== undefined) closeSync(fd);
  }
}
