/**
 * The service's durable log: one JSON event per line, appended and fsync'd before the caller is answered, so
 * whatever a client was told happened survives kill -9 and power loss. Appends that arrive while a write is in
 * flight are committed together (group commit): one write for the batch, which is what keeps the fsync off the
 * per-request latency at high call rates. The file is opened O_DSYNC, so that write returns once the data is on
 * disk, as a write and an fdatasync would, in one trip to the thread pool instead of two.
 *
 * On open the file is replayed. A process killed mid-append leaves at most one torn last line, which no caller
 * was ever told about (its fsync never returned), so it is cut off; a malformed line anywhere else is damage and
 * refuses to start with the line number.
 *
 * Compaction (with a `rewrite` function): once the file passes `compactBytes` and twice its size after the last
 * compaction, `rewrite` writes the events committed so far, compacted, into a new file and fsyncs it, beside the
 * writer (off the event loop: src/serve/compact-worker.ts), while appends go on to the log. Then the writer,
 * between two batches, copies the lines appended meanwhile to the new file, fsyncs it, renames it over the log
 * and fsyncs the directory; appends arriving during that last part wait, so the pause is bounded by what was
 * appended during the rewrite, not by the log's size. Killed before the rename, the old file is whole (the new
 * one is removed on open); after it, the new one is. The rewrite's events must replay to the state the original
 * prefix does (src/serve/compact.ts), so the lines after it apply on the same state.
 */
import { closeSync, constants, fdatasyncSync, fstatSync, ftruncateSync, mkdirSync, openSync, readFileSync, rmSync } from 'node:fs';
import { open, rename, type FileHandle } from 'node:fs/promises';
import { dirname } from 'node:path';
import { performance } from 'node:perf_hooks';
import { TreepackError } from '../errors.js';
import { ioError } from '../io/atomic.js';
import { killPoint } from './faults.js';

/** append, and each write returns once its data is durable (O_DSYNC: fdatasync's guarantee) */
const APPEND_DURABLE = constants.O_WRONLY | constants.O_APPEND | constants.O_CREAT | constants.O_DSYNC;
/** the log's and its compacted copy's file mode: owner read and write only */
export const LOG_MODE = 0o600;

export interface LogEvent {
  type: string;
  [key: string]: unknown;
}

interface Pending {
  bytes: Buffer;
  resolve: () => void;
  reject: (err: unknown) => void;
}

export interface CompactOptions {
  /**
   * Writes to `tmp`, fsync'd, events whose replay leaves the state the first `upto` bytes of the log at `path`
   * (whole committed lines) leave; resolves to the bytes written. Runs while the log is appended to.
   */
  rewrite: (path: string, upto: number, tmp: string) => Promise<number>;
  /** the smallest file compacted */
  compactBytes: number;
}

/** A compaction in flight: the prefix it rewrites, its file, and its size once written. */
interface Rewrite {
  upto: number;
  tmp: string;
  size?: number;
  done: Promise<void>;
}

export class DurableLog {
  /** told how long each group commit's durable write took, in seconds */
  onWrite: (seconds: number) => void = () => {};
  private queue: Pending[] = [];
  private writing = false;
  private closed = false;
  /** Bytes committed to the file so far (replayed plus appended). */
  bytes = 0;
  events = 0;
  compactions = 0;
  private compactAt = Infinity;
  private rewriting: Rewrite | undefined;
  /** a compaction that failed after its rename: every later append fails */
  private failed: Error | undefined;

  private constructor(
    readonly path: string,
    private fh: FileHandle,
    private readonly compaction: CompactOptions | undefined,
  ) {}

  /** Opens (creating) the log at `path`, calling `apply` on every committed event in order before returning. */
  static async open(
    path: string,
    apply: (e: LogEvent, line: number, bytes: number) => void,
    compaction?: CompactOptions,
  ): Promise<DurableLog> {
    // Owner only: the log holds every prompt and answer. A directory made here is private too; one that exists is
    // the operator's to set.
    try {
      mkdirSync(dirname(path), { recursive: true, mode: 0o700 });
    } catch (err) {
      throw ioError(err, dirname(path), 'create the log directory');
    }
    rmSync(path + '.compact', { force: true }); // a compaction killed before its rename: the log itself is whole
    const committed = replay(path, apply);
    let fh: FileHandle;
    try {
      fh = await open(path, APPEND_DURABLE, LOG_MODE);
      await fh.chmod(LOG_MODE); // a log written by an earlier version may be readable by others
    } catch (err) {
      throw ioError(err, path);
    }
    const log = new DurableLog(path, fh, compaction);
    log.bytes = committed.bytes;
    log.events = committed.events;
    if (compaction) log.compactAt = compaction.compactBytes;
    return log;
  }

  /** An event as the line the log holds. */
  static line(event: LogEvent): Buffer {
    return Buffer.from(JSON.stringify(event) + '\n');
  }

  /** Resolves once `event` is on disk. */
  append(event: LogEvent): Promise<void> {
    return this.appendLine(DurableLog.line(event));
  }

  /** Resolves once `bytes`, an event's line (`DurableLog.line`), is on disk. */
  appendLine(bytes: Buffer): Promise<void> {
    if (this.closed) return Promise.reject(new TreepackError('E_IO', 'the log is closed', { file: this.path }));
    return new Promise((resolve, reject) => {
      this.queue.push({ bytes, resolve, reject });
      if (!this.writing) void this.flush();
    });
  }

  private async flush(): Promise<void> {
    this.writing = true;
    for (;;) {
      if (this.rewriting?.size !== undefined) await this.swap();
      if (this.queue.length === 0) break;
      const batch = this.queue;
      this.queue = [];
      const bytes = Buffer.concat(batch.map((p) => p.bytes));
      try {
        if (this.failed) throw this.failed;
        const t0 = performance.now();
        let off = 0;
        while (off < bytes.length) off += (await this.fh.write(bytes, off)).bytesWritten;
        this.onWrite((performance.now() - t0) / 1000);
        this.bytes += bytes.length;
        this.events += batch.length;
        for (const p of batch) p.resolve();
      } catch (err) {
        const e = ioError(err, this.path);
        for (const p of batch) p.reject(e);
      }
      if (!this.rewriting && this.bytes >= this.compactAt) this.startRewrite();
    }
    this.writing = false;
  }

  /** Starts compacting the lines committed so far; the writer swaps the result in once it is written. */
  private startRewrite(): void {
    const r: Rewrite = { upto: this.bytes, tmp: this.path + '.compact', done: Promise.resolve() };
    r.done = this.compaction!.rewrite(this.path, r.upto, r.tmp).then(
      (size) => {
        r.size = size;
        if (!this.writing) void this.flush();
      },
      () => this.dropRewrite(r),
    );
    this.rewriting = r;
  }

  /** Compaction is an optimisation: on failure the log stays as it was, and is compacted again at twice the size. */
  private dropRewrite(r: Rewrite): void {
    rmSync(r.tmp, { force: true });
    this.rewriting = undefined;
    this.compactAt = Math.max(this.compaction!.compactBytes, 2 * this.bytes);
  }

  /** Copies the lines appended during the rewrite to it and puts it in the log's place; appends wait meanwhile. */
  private async swap(): Promise<void> {
    const r = this.rewriting!;
    const tail = Buffer.alloc(this.bytes - r.upto);
    try {
      if (this.failed) throw this.failed;
      const src = await open(this.path, 'r');
      try {
        for (let off = 0; off < tail.length;) {
          const { bytesRead } = await src.read(tail, off, tail.length - off, r.upto + off);
          if (bytesRead === 0) throw new Error('the log is shorter than its committed lines');
          off += bytesRead;
        }
      } finally {
        await src.close();
      }
      const fh = await open(r.tmp, 'a');
      try {
        await fh.writeFile(tail);
        await fh.datasync();
      } finally {
        await fh.close();
      }
      killPoint('TREEPACK_SERVE_COMPACT_FAULT', 'written');
      await rename(r.tmp, this.path);
    } catch {
      return this.dropRewrite(r);
    }
    this.rewriting = undefined;
    killPoint('TREEPACK_SERVE_COMPACT_FAULT', 'renamed');
    try {
      const dir = await open(dirname(this.path), 'r');
      await dir.sync().finally(() => dir.close());
      const fh = await open(this.path, APPEND_DURABLE, LOG_MODE);
      await this.fh.close();
      this.fh = fh;
    } catch (err) {
      // The handle may still point at the file renamed over: nothing more may be written through it.
      this.failed = err instanceof Error ? err : new Error(String(err));
      return;
    }
    this.bytes = r.size! + tail.length;
    this.compactAt = Math.max(this.compaction!.compactBytes, 2 * this.bytes);
    this.compactions++;
  }

  async close(): Promise<void> {
    this.closed = true;
    await this.rewriting?.done; // then swapped in by the writer, or dropped
    while (this.writing) await new Promise((r) => setImmediate(r));
    await this.fh.close();
  }
}

/** Applies every complete line; cuts a torn tail (no newline, or unparsable last line) and returns the sizes. */
function replay(path: string, apply: (e: LogEvent, line: number, bytes: number) => void): { bytes: number; events: number } {
  let data: Buffer;
  try {
    data = readFileSync(path);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') return { bytes: 0, events: 0 };
    throw ioError(err, path);
  }
  const committed = scan(data, path, apply);
  if (committed.bytes < data.length) truncate(path, committed.bytes);
  return committed;
}

/**
 * Applies every complete line of `data` (with its line number and its size in bytes, newline included); stops
 * before a torn tail and returns the committed sizes.
 */
export function scan(
  data: Buffer,
  path: string,
  apply: (e: LogEvent, line: number, bytes: number) => void,
): { bytes: number; events: number } {
  let start = 0;
  let line = 0;
  let events = 0;
  while (start < data.length) {
    const nl = data.indexOf(10, start);
    line++;
    if (nl < 0) break; // torn tail: never acknowledged
    let event: LogEvent;
    try {
      event = JSON.parse(data.toString('utf8', start, nl)) as LogEvent;
    } catch (e) {
      if (nl === data.length - 1) break; // a torn last line that happened to end in a newline byte
      throw new TreepackError('E_INPUT', `damaged log: ${(e as Error).message}`, { file: path, line });
    }
    apply(event, line, nl + 1 - start);
    events++;
    start = nl + 1;
  }
  return { bytes: start, events };
}

function truncate(path: string, size: number): void {
  try {
    const fd = openSync(path, 'r+');
    try {
      if (fstatSync(fd).size > size) ftruncateSync(fd, size);
      fdatasyncSync(fd);
    } finally {
      closeSync(fd);
    }
  } catch (err) {
    throw ioError(err, path);
  }
}
