/**
 * The output directory of `treepack pack`: micro-batch files and manifest.json, published by src/io/publish.ts as
 * one generation: files are staged privately and become visible only through the new manifest, renamed into place
 * as the single commit point once the whole input was read without error. Bad input, a full disk or a kill
 * never leaves partial files where a reader looks, and never damages a previous run's output.
 */
import { TreepackError } from '../errors.js';
import { writeMicroBatch } from './microbatch.js';
import { openPublish, type PublishRun } from './publish.js';
import { manifestBytes, type Manifest, type ManifestEntry, type ManifestHeader, type Sink, type SinkMicroBatch } from './sink.js';

/** A sink that publishes a run into a directory atomically: micro-batch files, then manifest.json as the commit point. */
export class DirectorySink implements Sink {
  readonly out: string;
  #run: PublishRun | undefined;
  #entries: ManifestEntry[] = [];
  #notes: readonly string[] = [];

  constructor(out: string) {
    this.out = out;
  }

  /** What publishing found and did that a user may want to know: staging of dead runs removed, garbage left. */
  get notes(): readonly string[] {
    return this.#notes;
  }

  /** Claims the next generation of `out` (the lock): fails at once, naming the path, if `out` is unusable. */
  open(): void {
    this.#run = openPublish(this.out);
    this.#notes = this.#run.notes;
    this.#entries = [];
  }

  write(mb: SinkMicroBatch): void {
    const file = this.#open().stage(mb.entry.file, (path) => writeMicroBatch(path, mb.batch, mb.masks?.tensors, mb.masks?.metadata));
    this.#entries.push({ ...mb.entry, file });
  }

  commit(header: ManifestHeader): Manifest {
    const run = this.#open();
    const { format, ...rest } = header;
    const manifest: Manifest = { format, generation: run.generation, ...rest, micro_batches: this.#entries };
    this.#run = undefined;
    run.commit(manifestBytes(manifest));
    return manifest;
  }

  abort(): void {
    this.#run?.abort();
    this.#run = undefined;
  }

  #open(): PublishRun {
    if (this.#run === undefined) throw new TreepackError('E_ARG', 'DirectorySink: write or commit before open()');
    return this.#run;
  }
}
