/** A one-line progress display on stderr, only when stderr is a terminal (never in pipes, logs or CI). */
import type { PackReport } from '../packer/index.js';

export function progressReporter(enabled = process.stderr.isTTY === true): { update: (s: PackReport) => void; done: () => void } {
  let last = 0;
  let shown = false;
  const update = (s: PackReport) => {
    if (!enabled) return;
    const now = Date.now();
    if (now - last < 200) return;
    last = now;
    shown = true;
    process.stderr.write(
      `\r\x1b[K  ${s.read.lines} lines, ${s.samples} samples, ${s.naiveTokens} naive tokens, ${s.microBatches} micro-batches`,
    );
  };
  const done = () => {
    if (shown) process.stderr.write('\r\x1b[K');
  };
  return { update, done };
}
