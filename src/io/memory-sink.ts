/** A sink that keeps each micro-batch's file bytes and the manifest in memory: for services and tests. */
import { microBatchBytes } from './microbatch.js';
import { MANIFEST_FILE, manifestBytes, type Manifest, type ManifestEntry, type ManifestHeader, type Sink, type SinkMicroBatch } from './sink.js';

export class MemorySink implements Sink {
  /** After commit: every file by name, manifest.json included, byte for byte as DirectorySink writes them. */
  files = new Map<string, Uint8Array>();
  #staged = new Map<string, Uint8Array>();
  #entries: ManifestEntry[] = [];

  open(): void {
    this.#staged = new Map();
    this.#entries = [];
  }

  write(mb: SinkMicroBatch): void {
    this.#staged.set(mb.entry.file, microBatchBytes(mb));
    this.#entries.push(mb.entry);
  }

  commit(header: ManifestHeader): Manifest {
    const manifest: Manifest = { ...header, micro_batches: this.#entries };
    this.files = new Map(this.#staged).set(MANIFEST_FILE, manifestBytes(manifest));
    this.#staged = new Map();
    return manifest;
  }

  abort(): void {
    this.#staged = new Map();
    this.#entries = [];
  }
}
