/**
 * A step's episodes → micro-batches, on the library packer: the episodes become the JSONL records
 * `treepack pack` reads (records.ts), in group order, and go through `packRecords` with the service's packer
 * options, so the service's micro-batches are exactly those of `treepack pack` on the same lines.
 *
 * Packing a step takes from milliseconds to seconds of CPU (chat templates, tokenizing, the merge), and the
 * event loop that answers every recorded call must not wait for it: steps are packed in a worker thread
 * (pack-worker.ts) holding its own tokenizer. The packer is a pure function of its input, so the worker's bytes
 * are the ones this thread would make. The episodes go over one message each, with the loop free in between,
 * so copying a large step out is no stall either. Options that cannot cross to a thread (a tokenizer object
 * already loaded, an onProgress callback) keep packing here. An episode whose records fail to pack is left out of
 * its step and reported (`quarantined`), so one tenant's poison never costs the others their step.
 */
import { setImmediate as yieldLoop } from 'node:timers/promises';
import type { Worker } from 'node:worker_threads';
import { microBatchBytes } from '../io/microbatch.js';
import { packRecords, type PackerOptions } from '../packer/index.js';
import type { ChatEncoder } from '../tokenize/chat.js';
import { PackerUnavailable, type PackedOut, type PackFn } from './feed.js';
import type { Metrics } from './metrics.js';
import type { Episode } from './pool.js';
import { quarantined, type Quarantined } from './quarantine.js';
import { emptyRecordStats, episodeLines, type RecordStats } from './records.js';
import { startWorker } from './thread.js';

/** One step packed: its micro-batches, how its calls' tokens were obtained, and the episodes packed out of it. */
export interface PackedStep {
  out: PackedOut[];
  stats: RecordStats;
  quarantined: Quarantined[];
}

type Line = Record<string, unknown>;

async function packLines(packer: PackerOptions, lines: Line[]): Promise<PackedOut[]> {
  const out: PackedOut[] = [];
  for await (const mb of packRecords(lines, { ...packer, name: 'service' })) {
    out.push({ bytes: microBatchBytes(mb), entry: { ...mb.entry } });
  }
  return out;
}

/**
 * The packing itself, the same in this thread and in the worker. An episode whose records cannot be made, or
 * cannot be packed, is packed out of the step (quarantine.ts) and the rest packed without it: a step that fails
 * as a whole is packed again one episode at a time to find the ones that fail alone, so a step without poison
 * costs one pass as before. A step that fails only as a whole (no episode fails alone) is the records' fault
 * still, and rejects as before.
 */
export async function packEpisodes(encoder: ChatEncoder, packer: PackerOptions, episodes: Episode[]): Promise<PackedStep> {
  const quarantine: Quarantined[] = [];
  let built: { ep: Episode; lines: Line[]; stats: RecordStats }[] = [];
  for (const ep of episodes) {
    const stats = emptyRecordStats();
    try {
      built.push({ ep, lines: episodeLines(ep, encoder, stats), stats });
    } catch (err) {
      quarantine.push(quarantined(ep, err, undefined));
    }
  }
  let out: PackedOut[];
  try {
    out = await packLines(
      packer,
      built.flatMap((b) => b.lines),
    );
  } catch (err) {
    const kept: typeof built = [];
    for (const b of built) {
      const failed =
        b.lines.length === 0
          ? undefined
          : await packLines(packer, b.lines).then(
              () => undefined,
              (e: unknown) => e,
            );
      if (failed === undefined) kept.push(b);
      else quarantine.push(quarantined(b.ep, failed, b.lines));
    }
    if (kept.length === built.length) throw err;
    built = kept;
    out = await packLines(
      packer,
      built.flatMap((b) => b.lines),
    );
  }
  const stats = emptyRecordStats();
  for (const b of built) for (const k of Object.keys(stats) as (keyof RecordStats)[]) stats[k] += b.stats[k];
  return { out, stats, quarantined: quarantine };
}

/** Messages to the worker: a step's episodes one at a time, then `pack`. */
export type ToWorker = { id: number; episode: Episode } | { id: number; pack: true };
/** From the worker: its tokenizer loaded (or not), then each step packed (or why not). */
export type FromWorker = { ready: true } | { failed: string } | { id: number; packed: PackedStep } | { id: number; error: string };

export interface StepPacker {
  pack(episodes: Episode[]): Promise<PackedStep>;
  /** whether steps are packed in a worker thread */
  readonly threaded: boolean;
  /** resolves once the packer can start a step at once (its thread's tokenizer loaded) */
  ready(): Promise<void>;
  close(): Promise<void>;
}

function cloneable(v: unknown): boolean {
  try {
    structuredClone(v);
    return true;
  } catch {
    return false;
  }
}

/**
 * The service's packer: in a worker thread, started now, unless the options cannot cross to one; then here, with
 * the encoder `encoder` makes (asked at the first step).
 */
export function stepPacker(packer: PackerOptions, encoder: () => Promise<ChatEncoder>): StepPacker {
  if (cloneable(packer)) return new PackThread(packer);
  let here: Promise<ChatEncoder> | undefined;
  return {
    threaded: false,
    pack: async (episodes) => packEpisodes(await (here ??= encoder()), packer, episodes),
    ready: async () => {},
    close: async () => {},
  };
}

/** A PackFn over `packer` that adds each step's record stats to `totals` and the metrics. */
export function countingPack(packer: StepPacker, metrics: Metrics, totals: RecordStats): PackFn {
  return async (episodes) => {
    const { out, stats, quarantined } = await packer.pack(episodes);
    for (const k of Object.keys(stats) as (keyof RecordStats)[]) {
      totals[k] += stats[k];
      if (stats[k]) metrics.prompts.inc({ tokens: k }, stats[k]);
    }
    return { out, quarantined };
  };
}

/** The worker, started at once (its tokenizer loads on its own thread) and again at the next step after it died. */
class PackThread implements StepPacker {
  readonly threaded = true;
  private worker: Worker | undefined;
  private loaded!: Promise<void>;
  private next = 0;
  private readonly waiting = new Map<number, { resolve: (p: PackedStep) => void; reject: (e: Error) => void }>();
  private closed = false;

  constructor(private readonly packer: PackerOptions) {
    this.worker = this.start();
  }

  private start(): Worker {
    const w = startWorker('pack-worker', { packer: this.packer });
    w.unref(); // an idle packer keeps no process alive
    let loaded!: { resolve: () => void; reject: (e: Error) => void };
    this.loaded = new Promise((resolve, reject) => (loaded = { resolve, reject }));
    this.loaded.catch(() => {}); // awaited by ready(); a packer never asked is not an unhandled failure
    w.on('message', (m: FromWorker) => {
      if ('ready' in m) return loaded.resolve();
      if ('failed' in m) return loaded.reject(new Error(m.failed));
      const p = this.waiting.get(m.id);
      if (!p) return;
      this.waiting.delete(m.id);
      if ('packed' in m) p.resolve(m.packed);
      else p.reject(new Error(m.error));
    });
    const fail = (why: string) => {
      loaded.reject(new PackerUnavailable(why));
      if (this.worker !== w) return;
      this.worker = undefined;
      for (const p of this.waiting.values()) p.reject(new PackerUnavailable(why));
      this.waiting.clear();
    };
    w.on('error', (err) => fail(err.message));
    w.on('exit', (code) => fail(`exited with code ${code}`));
    return w;
  }

  ready(): Promise<void> {
    return this.loaded;
  }

  async pack(episodes: Episode[]): Promise<PackedStep> {
    if (this.closed) throw new PackerUnavailable('the service is closing');
    const w = (this.worker ??= this.start());
    const id = this.next++;
    const done = new Promise<PackedStep>((resolve, reject) => this.waiting.set(id, { resolve, reject }));
    done.catch(() => {}); // observed by the caller below; a failure while still sending must not go unhandled
    for (const episode of episodes) {
      if (this.worker !== w) break; // it died: `done` says so
      w.postMessage({ id, episode } satisfies ToWorker);
      await yieldLoop();
    }
    if (this.worker === w) w.postMessage({ id, pack: true } satisfies ToWorker);
    return done;
  }

  async close(): Promise<void> {
    this.closed = true;
    const w = this.worker;
    this.worker = undefined;
    for (const p of this.waiting.values()) p.reject(new PackerUnavailable('the service is closing'));
    this.waiting.clear();
    await w?.terminate();
  }
}
