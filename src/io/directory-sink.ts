/**
 * The output directory of `treepack pack`: micro-batch files and manifest.json. Everything goes to a staging
 * directory first and is published only on commit, after the whole input was read without error, so bad input
 * never leaves partial files and never replaces a previous run's output.
 */
import { mkdirSync, readdirSync, renameSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { TreepackError } from '../errors.js';
import { writeFileAtomic } from './atomic.js';
import { writeMicroBatch } from './microbatch.js';
import { MANIFEST_FILE, manifestBytes, type Manifest, type ManifestEntry, type ManifestHeader, type Sink, type SinkMicroBatch } from './sink.js';

export class DirectorySink implements Sink {
  readonly out: string;
  #staging: string | undefined;
  #entries: ManifestEntry[] = [];

  constructor(out: string) {
    this.out = out;
  }

  open(): void {
    mkdirSync(this.out, { recursive: true });
    const staging = join(this.out, `.treepack-staging-${process.pid}`);
    mkdirSync(staging);
    this.#staging = staging;
    this.#entries = [];
  }

  write(mb: SinkMicroBatch): void {
    writeMicroBatch(join(this.#openStaging(), mb.entry.file), mb.batch, mb.masks?.tensors, mb.masks?.metadata);
    this.#entries.push(mb.entry);
  }

  commit(header: ManifestHeader): Manifest {
    const manifest: Manifest = { ...header, micro_batches: this.#entries };
    publish(this.out, this.#openStaging(), manifest);
    this.#staging = undefined;
    return manifest;
  }

  abort(): void {
    if (this.#staging !== undefined) rmSync(this.#staging, { recursive: true, force: true });
    this.#staging = undefined;
  }

  #openStaging(): string {
    if (this.#staging === undefined) throw new TreepackError('E_ARG', 'DirectorySink: write or commit before open()');
    return this.#staging;
  }
}

// ---- publish: staging directory → output directory -------------------------------------------------------------

/**
 * Moves the staged files of `manifest` into `out` and writes the manifest. The manifest is the commit point: the
 * old one goes before any file is replaced and the new one is written last, so a crash while publishing leaves
 * no manifest rather than one that contradicts the files.
 */
function publish(out: string, staging: string, manifest: Manifest): void {
  rmSync(join(out, MANIFEST_FILE), { force: true });
  for (const m of manifest.micro_batches) renameSync(join(staging, m.file), join(out, m.file));
  rmSync(staging, { recursive: true, force: true });
  const keep = new Set(manifest.micro_batches.map((m) => m.file));
  // A previous run may have written more micro-batches; they would contradict the new manifest.
  for (const f of readdirSync(out)) if (/^microbatch-\d+\.safetensors$/.test(f) && !keep.has(f)) rmSync(join(out, f));
  writeFileAtomic(join(out, MANIFEST_FILE), [manifestBytes(manifest)]);
}
