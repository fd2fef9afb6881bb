/**
 * The log's compaction off the event loop (log.ts, compact.ts): reads the first `upto` bytes of the log (whole
 * committed lines), compacts their events and writes the result to `tmp`, fsync'd; answers its size. Parsing and
 * rewriting a log of many megabytes takes a while, and the service answers calls meanwhile.
 */
import { closeSync, fdatasyncSync, openSync, readSync } from 'node:fs';
import { parentPort, workerData } from 'node:worker_threads';
import { writeAll } from '../io/atomic.js';
import { compactEvents } from './compact.js';
import { LOG_MODE, scan, type LogEvent } from './log.js';

const { path, upto, tmp, groupSize } = workerData as { path: string; upto: number; tmp: string; groupSize: number };

const data = Buffer.alloc(upto);
const src = openSync(path, 'r');
try {
  for (let off = 0; off < upto;) {
    const n = readSync(src, data, off, upto - off, off);
    if (n === 0) throw new Error(`${path}: shorter than its ${upto} committed bytes`);
    off += n;
  }
} finally {
  closeSync(src);
}
const events: LogEvent[] = [];
scan(data, path, (e) => events.push(e));
const out = Buffer.from(
  compactEvents(events, groupSize)
    .map((e) => JSON.stringify(e) + '\n')
    .join(''),
);
const dst = openSync(tmp, 'w', LOG_MODE);
try {
  writeAll(dst, [out]);
  fdatasyncSync(dst);
} finally {
  closeSync(dst);
}
parentPort!.postMessage(out.length);
