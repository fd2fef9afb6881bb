/**
 * The whole pipeline over one input: a JSONL file, `-` (stdin), a Readable of JSONL, or an (async) iterable of
 * parsed records or JSON objects. `treepack pack` is `packRecords(input, opts).writeTo(new DirectorySink(out))`.
 */
import { performance } from 'node:perf_hooks';
import { Readable } from 'node:stream';
import { TreepackError } from '../errors.js';
import type { Manifest, Sink } from '../io/sink.js';
import { inputName } from '../records/jsonl.js';
import { readRecords } from '../records/read.js';
import { PackerCore, type PackedMicroBatch } from './core.js';
import { Intake } from './incremental.js';
import { resolveOptions, type PackerOptions } from './options.js';
import { emptyReport, manifestHeader, type PackReport } from './report.js';

/** What packRecords reads: a JSONL path, `-` for stdin, a Readable of JSONL, or an iterable of records or parsed JSON objects. */
export type PackInput = string | Readable | Iterable<unknown> | AsyncIterable<unknown>;

/** A packing run: iterate it for the micro-batches in memory, or write them to a sink; `report()` gives its figures. */
export interface PackRun extends AsyncIterable<PackedMicroBatch> {
  /** The run's figures so far; complete once iteration has finished. */
  report(): PackReport;
  /**
   * Writes every micro-batch to `sink` and commits it with the manifest; on any error the sink is aborted (a
   * previous commit's output stays) and the error rethrown.
   */
  writeTo(sink: Sink): Promise<Manifest>;
}

/**
 * Packs the records of `input` into prefix-tree micro-batches with `options` (the packer's option table,
 * docs/reference/cli.md): the library form of `treepack pack`.
 */
export function packRecords(input: PackInput, options: PackerOptions = {}): PackRun {
  const opts = resolveOptions(options);
  const jsonl = typeof input === 'string' || input instanceof Readable;
  if (!jsonl && !(input !== null && typeof input === 'object' && (Symbol.iterator in input || Symbol.asyncIterator in input))) {
    throw new TreepackError('E_ARG', 'packRecords: expected a JSONL path, "-", a Readable, or an iterable of records or JSON objects');
  }
  const core = new PackerCore(opts, emptyReport(jsonl ? inputName(input, options.name) : (options.name ?? '<stream>')));
  let started = false;

  async function* run(): AsyncGenerator<PackedMicroBatch> {
    await core.init();
    const intake = new Intake(core, opts);
    const feed: (value: unknown) => void = jsonl ? (rec) => core.accept(rec as never) : (value) => intake.push(value);
    const source = jsonl
      ? readRecords(input, {
          vocabSize: opts.vocabSize,
          stats: core.report.read,
          name: options.name,
          repeatedEpisodeIds: opts.repeatedEpisodeIds,
          lossyUtf8: opts.lossyUtf8,
        })
      : toAsyncIterator(input as Iterable<unknown> | AsyncIterable<unknown>);
    try {
      for (;;) {
        const t0 = performance.now();
        const next = await source.next();
        if (!next.done) feed(next.value);
        core.report.seconds.readParse += (performance.now() - t0) / 1000;
        if (next.done) break;
        yield* core.take(false);
      }
      yield* core.take(true);
    } finally {
      // A consumer that stops early (or an error) closes the input: a file stream is not left open.
      await source.return?.();
    }
  }

  const pack: PackRun = {
    [Symbol.asyncIterator]() {
      if (started) throw new TreepackError('E_ARG', 'a PackRun is iterated once; call packRecords again');
      started = true;
      return run();
    },
    report: () => core.report,
    async writeTo(sink) {
      sink.open();
      try {
        for await (const mb of pack) sink.write(mb);
      } catch (err) {
        sink.abort();
        throw err;
      }
      return sink.commit(manifestHeader(core.report));
    },
  };
  return pack;
}

function toAsyncIterator(it: Iterable<unknown> | AsyncIterable<unknown>): AsyncIterator<unknown> | Iterator<unknown> {
  return Symbol.asyncIterator in it ? it[Symbol.asyncIterator]() : it[Symbol.iterator]();
}
