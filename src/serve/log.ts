/**
 * The service's durable log: one JSON event per line, appended and fsync'd before the caller is answered, so
 * whatever a client was told happened survives kill -9 and power loss. Appends that arrive while a write is in
 * flight are committed together (group commit): one write and one fdatasync for the batch, which is what keeps
 * the fsync off the per-request latency at high call rates.
 *
 * On open the file is replayed. A process killed mid-append leaves at most one torn last line, which no caller
 * was ever told about (its fsync never returned), so it is cut off; a malformed line anywhere else is damage and
 * refuses to start with the line number.
 */
import { closeSync, fdatasyncSync, fstatSync, ftruncateSync, mkdirSync, openSync, readFileSync } from 'node:fs';
import { open, type FileHandle } from 'node:fs/promises';
import { dirname } from 'node:path';
import { TreepackError } from '../errors.js';
import { ioError } from '../io/atomic.js';

export interface LogEvent {
  type: string;
  [key: string]: unknown;
}

interface Pending {
  bytes: Buffer;
  resolve: () => void;
  reject: (err: unknown) => void;
}

export class DurableLog {
  private queue: Pending[] = [];
  private writing = false;
  private closed = false;
  /** Bytes committed to the file so far (replayed plus appended). */
  bytes = 0;
  events = 0;

  private constructor(
    readonly path: string,
    private readonly fh: FileHandle,
  ) {}

  /** Opens (creating) the log at `path`, calling `apply` on every committed event in order before returning. */
  static async open(path: string, apply: (e: LogEvent, line: number) => void): Promise<DurableLog> {
    mkdirSync(dirname(path), { recursive: true });
    const committed = replay(path, apply);
    let fh: FileHandle;
    try {
      fh = await open(path, 'a');
    } catch (err) {
      throw ioError(err, path);
    }
    const log = new DurableLog(path, fh);
    log.bytes = committed.bytes;
    log.events = committed.events;
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
        let off = 0;
        while (off < bytes.length) off += (await this.fh.write(bytes, off)).bytesWritten;
        await this.fh.datasync();
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
  if (start < data.length) truncate(path, start);
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
