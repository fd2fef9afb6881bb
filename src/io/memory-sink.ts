/** A sink that keeps each micro-batch's file bytes and the manifest in memory: for services and tests. */
import { microBatchBytes } from './microbatch.js';
import {
  MANIFEST_FILE,
  manifestBytes,
  type Manifest,
  type ManifestEntry,
  type ManifestHeader,
  type Sink,
  type SinkMicroBatch,
} from './sink.js';

/** A sink that keeps the files in memory, byte for byte as DirectorySink writes them. */
export class MemorySink implements Sink {
  /**
   * After commit: every file by name, manifest.json included. Micro-batch files are byte for byte as DirectorySink
   * writes them; DirectorySink's manifest also records the generation directory they live in (`generation`,
   * `gen-NNNNNN/` in each entry's file).
   */
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
