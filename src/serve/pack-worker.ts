/**
 * The packing thread (packing.ts): receives a step's episodes one message at a time, packs them with its own
 * tokenizer, and sends the micro-batches back, their bytes moved rather than copied. Steps are packed one after
 * another, in the order asked.
 */
import { parentPort, workerData } from 'node:worker_threads';
import type { PackerOptions } from '../packer/index.js';
import { ChatEncoder } from '../tokenize/chat.js';
import { resolveTokenizer } from '../tokenize/tokenizer.js';
import { packEpisodes, type FromWorker, type ToWorker } from './packing.js';
import type { Episode } from './pool.js';

const port = parentPort!;
const { packer } = workerData as { packer: PackerOptions };
const encoder = resolveTokenizer(packer.tokenizer).then((t) => new ChatEncoder(t));
encoder.then(
  () => port.postMessage({ ready: true } satisfies FromWorker),
  (err: Error) => port.postMessage({ failed: err.message } satisfies FromWorker),
);
const steps = new Map<number, Episode[]>();
let queue = Promise.resolve();

async function packStep(id: number, episodes: Episode[]): Promise<void> {
  let reply: FromWorker;
  const moved: ArrayBuffer[] = [];
  try {
    const packed = await packEpisodes(await encoder, packer, episodes);
    for (const o of packed.out) {
      // Only a buffer of its own can be moved (a pooled Buffer's memory is shared with others).
      if (o.bytes.byteOffset !== 0 || o.bytes.byteLength !== o.bytes.buffer.byteLength) o.bytes = new Uint8Array(o.bytes);
      moved.push(o.bytes.buffer as ArrayBuffer);
    }
    reply = { id, packed };
  } catch (err) {
    reply = { id, error: (err as Error).message };
  }
  port.postMessage(reply, moved);
}

port.on('message', (m: ToWorker) => {
  if ('episode' in m) {
    let eps = steps.get(m.id);
    if (!eps) steps.set(m.id, (eps = []));
    eps.push(m.episode);
    return;
  }
  const episodes = steps.get(m.id) ?? [];
  steps.delete(m.id);
  queue = queue.then(() => packStep(m.id, episodes));
});
