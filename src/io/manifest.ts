/**
 * Reading a packed output directory. `<dir>/manifest.json` is where every reader starts: it is the commit point of
 * the run that wrote the directory (src/io/publish.ts), and only the files it names belong to that run. Other
 * files in the directory (the previous generation, a run in progress) are never read, so a directory is never
 * globbed.
 */
import { readFileSync } from 'node:fs';
import { isAbsolute, join, normalize, sep } from 'node:path';
import { TreepackError } from '../errors.js';
import { ioError } from './atomic.js';
import { readMicroBatch, type MicroBatchFile } from './microbatch.js';
import { MANIFEST_FILE, MANIFEST_FORMAT, type Manifest, type ManifestEntry } from './sink.js';

const COUNTS = ['sequences', 'naive_tokens', 'packed_tokens'] as const;

/** Reads and checks `<dir>/manifest.json`; every problem is E_INPUT naming the manifest and the field. */
export function readManifest(dir: string): Manifest {
  const path = join(dir, MANIFEST_FILE);
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch (err) {
    throw ioError(err, path, 'read the manifest');
  }
  const fail = (field: string, message: string) => new TreepackError('E_INPUT', message, { file: path, field });
  let doc: Manifest;
  try {
    doc = JSON.parse(text) as Manifest;
  } catch (err) {
    throw new TreepackError('E_INPUT', `not JSON: ${(err as Error).message}`, { file: path });
  }
  if (doc === null || typeof doc !== 'object' || Array.isArray(doc))
    throw new TreepackError('E_INPUT', 'not a JSON object', { file: path });
  if (doc.format !== MANIFEST_FORMAT)
    throw fail('format', `format is ${JSON.stringify(doc.format)}, expected ${JSON.stringify(MANIFEST_FORMAT)}`);
  if (!Array.isArray(doc.micro_batches)) throw fail('micro_batches', 'micro_batches is not a list');
  doc.micro_batches.forEach((e, i) => {
    const at = `micro_batches[${i}]`;
    if (e === null || typeof e !== 'object') throw fail(at, `${at} is not an object`);
    const f = e.file;
    // A manifest only names files inside its directory: no absolute paths, no way up.
    if (
      typeof f !== 'string' ||
      f === '' ||
      isAbsolute(f) ||
      f.includes('\\') ||
      normalize(f) !== f.split('/').join(sep) ||
      f.split('/').includes('..')
    ) {
      throw fail(`${at}.file`, `${at}.file is ${JSON.stringify(f)}, expected a relative path inside the directory`);
    }
    for (const k of COUNTS) {
      if (!Number.isSafeInteger(e[k]) || e[k] < 0)
        throw fail(`${at}.${k}`, `${at}.${k} is ${JSON.stringify(e[k])}, expected an integer >= 0`);
    }
  });
  return doc;
}

/** The micro-batch files of `dir`, in manifest order: join(dir, entry.file) for each entry. */
export function microBatchPaths(dir: string): string[] {
  return readManifest(dir).micro_batches.map((e) => join(dir, e.file));
}

/** A micro-batch of an output directory, with its manifest entry and path. */
export interface DirectoryMicroBatch extends MicroBatchFile {
  entry: ManifestEntry;
  path: string;
}

/**
 * Reads the micro-batches `dir`'s manifest names, in order, checking each against its entry (a file that
 * disagrees with the manifest comes from another run: E_INPUT naming it).
 */
export function* readMicroBatches(dir: string): Generator<DirectoryMicroBatch> {
  for (const entry of readManifest(dir).micro_batches) {
    const path = join(dir, entry.file);
    const mb = readMicroBatch(path);
    const meta = mb.batch.meta;
    const got = { sequences: meta.num_sequences, naive_tokens: meta.num_tokens_naive, packed_tokens: meta.num_tokens_packed };
    for (const k of COUNTS) {
      if (got[k] !== entry[k]) {
        throw new TreepackError('E_INPUT', `the manifest says ${k} = ${entry[k]} but the file has ${got[k]} (a file of another run?)`, {
          file: path,
          field: k,
        });
      }
    }
    yield { ...mb, entry, path };
  }
}
