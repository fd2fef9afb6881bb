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
 * Compaction (with a `compact` function): once the file passes `compactBytes` and twice its size after the last
 * compaction, the writer, between two batches, rewrites the committed events as `compact` returns them into a
 * new file, fsyncs it, renames it over the log and fsyncs the directory. Appends arriving meanwhile wait and go
 * to the new file. Killed before the rename, the old file is whole (the new one is removed on open); after it,
 * the new one is; `compact` must return events whose replay equals the original's (src/serve/compact.ts).
 */
import { closeSync, constants, fdatasyncSync, fstatSync, ftruncateSync, mkdirSync, openSync, readFileSync, rmSync } from 'node:fs';
import { open, readFile, rename, type FileHandle } from 'node:fs/promises';
import { dirname } from 'node:path';
import { TreepackError } from '../errors.js';
import { ioError } from '../io/atomic.js';
import { killPoint } from './faults.js';

/** append, and each write returns once its data is durable (O_DSYNC: fdatasync's guarantee) */
const APPEND_DURABLE = constants.O_WRONLY | constants.O_APPEND | constants.O_CREAT | constants.O_DSYNC;

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
  /** the committed events → events whose replay leaves the same state */
  compact: (events: LogEvent[]) => LogEvent[];
  /** the smallest file compacted */
  compactBytes: number;
}

export class DurableLog {
  private queue: Pending[] = [];
  private writing = false;
  private closed = false;
  /** Bytes committed to the file so far (replayed plus appended). */
  bytes = 0;
  events = 0;
  compactions = 0;
  private compactAt = Infinity;
  /** a compaction that failed after its rename: every later append fails */
  private failed: unknown;

  private constructor(
    readonly path: string,
    private fh: FileHandle,
    private readonly compaction: CompactOptions | undefined,
  ) {}

  /** Opens (creating) the log at `path`, calling `apply` on every committed event in order before returning. */
  static async open(path: string, apply: (e: LogEvent, line: number) => void, compaction?: CompactOptions): Promise<DurableLog> {
    mkdirSync(dirname(path), { recursive: true });
    rmSync(path + '.compact', { force: true }); // a compaction killed before its rename: the log itself is whole
    const committed = replay(path, apply);
    let fh: FileHandle;
    try {
      fh = await open(path, APPEND_DURABLE);
    } catch (err) {
      throw ioError(err, path);
    }
    const log = new DurableLog(path, fh, compaction);
    log.bytes = committed.bytes;
    log.events = committed.events;
    if (compaction) log.compactAt = compaction.compactBytes;
    return log;
  }

  /** Resolves once `event` is on disk. */
  append(event: LogEvent): Promise<void> {
    if (this.closed) return Promise.reject(new TreepackError('E_IO', 'the log is closed', { file: this.path }));
    const bytes = Buffer.from(JSON.stringify(event) + '\n');
    return new Promise((resolve, reject) => {
      this.queue.push({ bytes, resolve, reject });
      if (!this.writing) void this.flush();
    });
  }

  private async flush(): Promise<void> {
    this.writing = true;
    while (this.queue.length > 0) {
      const batch = this.queue;
      this.queue = [];
      const bytes = Buffer.concat(batch.map((p) => p.bytes));
      try {
        if (this.failed) throw this.failed;
        if (this.bytes >= this.compactAt) await this.compact();
        let off = 0;
        while (off < bytes.length) off += (await this.fh.write(bytes, off)).bytesWritten;
        this.bytes += bytes.length;
        this.events += batch.length;
        for (const p of batch) p.resolve();
      } catch (err) {
        const e = ioError(err, this.path);
        for (const p of batch) p.reject(e);
      }
    }
    this.writing = false;
  }

  /** Rewrites the committed events compacted; a failure before the rename leaves the log as it was. */
  private async compact(): Promise<void> {
    const { compact, compactBytes } = this.compaction!;
    const tmp = this.path + '.compact';
    let out: Buffer;
    try {
      const events: LogEvent[] = [];
      scan(await readFile(this.path), this.path, (e) => events.push(e));
      const kept = compact(events);
      out = Buffer.from(kept.map((e) => JSON.stringify(e) + '\n').join(''));
      const fh = await open(tmp, 'w');
      try {
        await fh.writeFile(out);
        await fh.datasync();
      } finally {
        await fh.close();
      }
      killPoint('TREEPACK_SERVE_COMPACT_FAULT', 'written');
      await rename(tmp, this.path);
    } catch {
      // Compaction is an optimisation: the log stays as it was, and is tried again at twice the size.
      rmSync(tmp, { force: true });
      this.compactAt = Math.max(compactBytes, 2 * this.bytes);
      return;
    }
    killPoint('TREEPACK_SERVE_COMPACT_FAULT', 'renamed');
    try {
      const dir = await open(dirname(this.path), 'r');
      await dir.sync().finally(() => dir.close());
      const fh = await open(this.path, APPEND_DURABLE);
      await this.fh.close();
      this.fh = fh;
    } catch (err) {
      // The handle may still point at the file renamed over: nothing more may be written through it.
      this.failed = err;
      throw err;
    }
    this.bytes = out.length;
    this.compactAt = Math.max(compactBytes, 2 * out.length);
    this.compactions++;
  }

  async close(): Promise<void> {
    this.closed = true;
    while (this.writing) await new Promise((r) => setImmediate(r));
    await this.fh.close();
  }
}

/** Applies every complete line; cuts a torn tail (no newline, or unparsable last line) and returns the sizes. */
function replay(path: string, apply: (e: LogEvent, line: number) => void): { bytes: number; events: number } {
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

/** Applies every complete line of `data`; stops before a torn tail and returns the committed sizes. */
function scan(data: Buffer, path: string, apply: (e: LogEvent, line: number) => void): { bytes: number; events: number } {
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
    apply(event, line);
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
