/**
 * Incremental use of the packer, for a service that receives records as they arrive: `push` records (parsed
 * TrainRecords, or the JSON objects of a JSONL line), `endGroup` when a group is complete, `drain` the
 * micro-batches of every closed window, `end` for the rest.
 *
 * Pushing the records of an input in its order, with any `drain` and `endGroup` calls in between, gives the
 * micro-batches `packRecords` gives on that input, byte for byte, as long as each `endGroup` is followed by a
 * record of another group (or by `end`): `endGroup` only closes the window the next group's first sample would
 * close. A different arrival order of groups may legitimately fill windows differently.
 */
import { TreepackError } from '../errors.js';
import { checkVocab, parseRecords } from '../records/read.js';
import { EpisodeIds } from '../records/episode-ids.js';
import type { Source, TrainRecord } from '../records/types.js';
import { PackerCore, type PackedMicroBatch } from './core.js';
import { resolveOptions, type PackerOptions, type ResolvedOptions } from './options.js';
import { emptyReport, type PackReport } from './report.js';

/** A parsed record (from `readRecords` or built by hand): what the readers produce. */
function isTrainRecord(v: unknown): v is TrainRecord {
  if (typeof v !== 'object' || v === null) return false;
  const r = v as Partial<TrainRecord>;
  return (r.kind === 'chat' || r.kind === 'sample') && typeof r.source === 'object' && r.source !== null;
}

/**
 * Turns pushed values into records for the core and counts input lines. One packer takes either parsed records
 * (each names its own source) or JSON objects (numbered as lines in push order), never both: mixed, a raw
 * object's line number and default id would not say where it came from.
 */
export class Intake {
  #core: PackerCore;
  #opts: ResolvedOptions;
  #mode: 'records' | 'json' | undefined;
  #lastSource: Source | undefined;
  #lastGroup: string | undefined;
  #episodes = new EpisodeIds();

  constructor(core: PackerCore, opts: ResolvedOptions) {
    this.#core = core;
    this.#opts = opts;
  }

  push(value: unknown, source?: Partial<Source>): void {
    const read = this.#core.report.read;
    const mode = isTrainRecord(value) ? 'records' : 'json';
    if (this.#mode !== undefined && mode !== this.#mode) {
      throw new TreepackError(
        'E_ARG',
        mode === 'records'
          ? 'push: a parsed record after JSON objects; one packer takes either parsed records or JSON objects'
          : 'push: a JSON object after parsed records; one packer takes either parsed records or JSON objects',
        { line: read.lines + 1 },
      );
    }
    let records: TrainRecord[];
    if (mode === 'records') {
      const rec = value as TrainRecord;
      if (rec.kind === 'sample' && this.#opts.vocabSize !== undefined) checkVocab(rec, this.#opts.vocabSize);
      records = [rec];
    } else {
      const line = source?.line ?? read.lines + 1;
      const named = source?.file ?? this.#core.report.input;
      // Default ids as readRecords makes them: `file:line` for a named input, `line-N` for a stream.
      records = parseRecords(
        value,
        { file: named, line },
        { vocabSize: this.#opts.vocabSize, defaultId: named === '<stream>' ? `line-${line}` : `${named}:${line}` },
      );
      if (!this.#opts.repeatedEpisodeIds) this.#episodes.check(value, records, JSON.stringify(value), named, line);
    }
    this.#mode = mode;
    if (mode === 'json') read.lines++;
    for (const rec of records) {
      // An episode line holds several records with one source: parsed records count a line per source, as the readers do.
      const prev = this.#lastSource;
      if (mode === 'records' && (prev?.file !== rec.source.file || prev?.line !== rec.source.line)) read.lines++;
      this.#lastSource = rec.source;
      read.records++;
      this.#lastGroup = rec.group;
      this.#core.accept(rec);
    }
  }

  endGroup(group?: string): void {
    if (group !== undefined && group !== this.#lastGroup) {
      throw new TreepackError(
        'E_ARG',
        `endGroup(${JSON.stringify(group)}) but the open group is ${this.#lastGroup === undefined ? 'none' : JSON.stringify(this.#lastGroup)}`,
      );
    }
    this.#core.endGroup();
  }
}

/** A packer fed one record at a time (a service, a trainer loop): push records, then take the micro-batches they make. */
export interface Packer {
  /** Queues a record (a TrainRecord, or one JSONL line's parsed object; a malformed one throws E_INPUT and is not taken). */
  push(record: unknown, source?: Partial<Source>): void;
  /** The group of the records pushed last is complete: its window may close without waiting for the next group. */
  endGroup(group?: string): void;
  /** Runs the queued records and returns the micro-batches of every window closed so far. */
  drain(): Promise<PackedMicroBatch[]>;
  /** Closes the last window and returns every micro-batch not yet returned; the packer takes nothing after. */
  end(): Promise<PackedMicroBatch[]>;
  report(): PackReport;
}

/** A packer fed record by record, with the options of packRecords. */
export function createPacker(options: PackerOptions = {}): Packer {
  const opts = resolveOptions(options);
  const core = new PackerCore(opts, emptyReport(options.name ?? '<stream>'));
  const intake = new Intake(core, opts);
  let state: 'open' | 'ended' | { failed: unknown } = 'open';
  let queue = Promise.resolve<unknown>(undefined);
  const check = (what: string) => {
    if (state === 'ended') throw new TreepackError('E_ARG', `${what} after end(): this packer is finished; create another`);
    if (typeof state === 'object')
      throw new TreepackError('E_ARG', `${what} after an error: this packer stopped at ${String(state.failed)}`);
  };
  // Work runs one call at a time, in call order, so concurrent drains never interleave.
  const run = (final: boolean): Promise<PackedMicroBatch[]> => {
    const result = queue.then(async () => {
      const out: PackedMicroBatch[] = [];
      try {
        for await (const mb of core.take(final)) out.push(mb);
      } catch (err) {
        state = { failed: err };
        throw err;
      }
      return out;
    });
    queue = result.catch(() => undefined);
    return result;
  };
  return {
    push(record, source) {
      check('push');
      intake.push(record, source);
    },
    endGroup(group) {
      check('endGroup');
      intake.endGroup(group);
    },
    async drain() {
      check('drain');
      return run(false);
    },
    async end() {
      check('end');
      state = 'ended';
      return run(true);
    },
    report: () => core.report,
  };
}
