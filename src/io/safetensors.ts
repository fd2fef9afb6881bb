/**
 * safetensors read/write (https://github.com/huggingface/safetensors): an 8-byte little-endian u64 header
 * length n, n bytes of UTF-8 JSON `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`
 * padded with spaces, then the data buffer that the offsets index.
 *
 * Layout written here:
 * - the header is `__metadata__` (when given) then the tensors in ascending name order (UTF-16 code-unit order),
 *   each as `{"dtype","shape","data_offsets"}`, compact JSON, padded with spaces so that 8 + n is a multiple of 8;
 * - the data is contiguous, ordered by element size descending, then by name. The data start is 8-aligned and
 *   every tensor's byte length is a multiple of its element size, so each tensor starts aligned to its element
 *   size: a reader holding the file in an 8-aligned buffer can view every tensor without copying.
 *
 * The reader accepts any layout the format allows (gaps between tensors included), so files from the Rust crate
 * or torch read as well.
 */
import { readFileSync } from 'node:fs';
import { argError, TreepackError } from '../errors.js';
import { ioError, writeFileAtomic } from './atomic.js';

export type TypedArray =
  | Uint8Array
  | Int8Array
  | Uint16Array
  | Int16Array
  | Uint32Array
  | Int32Array
  | Float32Array
  | Float64Array
  | BigInt64Array
  | BigUint64Array;

interface ArrayCtor {
  new (length: number): TypedArray;
  new (buffer: ArrayBufferLike, byteOffset: number, length: number): TypedArray;
  readonly BYTES_PER_ELEMENT: number;
}

/**
 * Dtypes with no JS array of their own (BOOL, F16, BF16, F8) are carried as their raw bits: enough to read
 * other tools' files and write them back unchanged.
 */
const DTYPES = {
  BOOL: Uint8Array,
  U8: Uint8Array,
  I8: Int8Array,
  F8_E4M3: Uint8Array,
  F8_E5M2: Uint8Array,
  U16: Uint16Array,
  I16: Int16Array,
  F16: Uint16Array,
  BF16: Uint16Array,
  U32: Uint32Array,
  I32: Int32Array,
  F32: Float32Array,
  U64: BigUint64Array,
  I64: BigInt64Array,
  F64: Float64Array,
} as const satisfies Record<string, ArrayCtor>;

export type Dtype = keyof typeof DTYPES;

export interface Tensor {
  dtype: Dtype;
  shape: readonly number[];
  data: TypedArray;
}

export interface SafetensorsContent {
  tensors: Map<string, Tensor>;
  metadata: Record<string, string>;
}

const METADATA_KEY = '__metadata__';

const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

function assertLittleEndian(): void {
  if (!LITTLE_ENDIAN)
    throw new TreepackError('E_IO', 'safetensors I/O needs a little-endian host (typed arrays are written as they lie in memory)');
}

function isDtype(s: unknown): s is Dtype {
  return typeof s === 'string' && Object.prototype.hasOwnProperty.call(DTYPES, s);
}

function dtypeSize(dtype: Dtype): number {
  return DTYPES[dtype].BYTES_PER_ELEMENT;
}

/** Number of elements of a shape, or -1 when it is not a list of non-negative safe integers. */
function numel(shape: unknown): number {
  if (!Array.isArray(shape)) return -1;
  let n = 1;
  for (const d of shape) {
    if (!Number.isSafeInteger(d) || d < 0) return -1;
    n *= d;
  }
  return Number.isSafeInteger(n) ? n : -1;
}

function compareNames(a: string, b: string): number {
  return a < b ? -1 : a > b ? 1 : 0;
}

/**
 * The bytes to write, in order: the header then a view on each tensor's data (no copies). Checks every entry;
 * a bad one is an E_ARG naming it.
 */
export function safetensorsChunks(tensors: ReadonlyMap<string, Tensor>, metadata?: Readonly<Record<string, string>>): Uint8Array[] {
  assertLittleEndian();
  for (const [name, t] of tensors) {
    if (name === METADATA_KEY || name.length === 0) throw argError('tensor name', `a non-empty name other than ${METADATA_KEY}`, name);
    if (!isDtype(t.dtype)) throw argError(`tensor ${JSON.stringify(name)} dtype`, `one of ${Object.keys(DTYPES).join(', ')}`, t.dtype);
    const ctor = DTYPES[t.dtype];
    if (!(t.data instanceof ctor)) throw argError(`tensor ${JSON.stringify(name)} data`, `a ${ctor.name} for dtype ${t.dtype}`, t.data);
    const n = numel(t.shape);
    if (n !== t.data.length) throw argError(`tensor ${JSON.stringify(name)} shape`, `a shape of ${t.data.length} elements`, t.shape);
  }
  if (metadata !== undefined) {
    for (const [k, v] of Object.entries(metadata)) {
      if (typeof v !== 'string') throw argError(`metadata ${JSON.stringify(k)}`, 'a string', v);
    }
  }
  const names = [...tensors.keys()];
  const dataOrder = names.slice().sort((a, b) => dtypeSize(tensors.get(b)!.dtype) - dtypeSize(tensors.get(a)!.dtype) || compareNames(a, b));
  const offsets = new Map<string, [number, number]>();
  let end = 0;
  for (const name of dataOrder) {
    const begin = end;
    end += tensors.get(name)!.data.byteLength;
    offsets.set(name, [begin, end]);
  }
  // Built by hand rather than with JSON.stringify of an object: integer-like keys would be reordered.
  const entries: string[] = [];
  if (metadata !== undefined) {
    const meta = Object.keys(metadata)
      .sort(compareNames)
      .map((k) => `${JSON.stringify(k)}:${JSON.stringify(metadata[k])}`);
    entries.push(`${JSON.stringify(METADATA_KEY)}:{${meta.join(',')}}`);
  }
  for (const name of names.sort(compareNames)) {
    const t = tensors.get(name)!;
    const [b, e] = offsets.get(name)!;
    entries.push(`${JSON.stringify(name)}:{"dtype":${JSON.stringify(t.dtype)},"shape":[${t.shape.join(',')}],"data_offsets":[${b},${e}]}`);
  }
  const json = Buffer.from(`{${entries.join(',')}}`, 'utf8');
  const n = Math.ceil(json.length / 8) * 8;
  const header = Buffer.alloc(8 + n, 0x20);
  header.writeBigUInt64LE(BigInt(n), 0);
  json.copy(header, 8);
  const chunks: Uint8Array[] = [header];
  for (const name of dataOrder) {
    const d = tensors.get(name)!.data;
    chunks.push(new Uint8Array(d.buffer, d.byteOffset, d.byteLength));
  }
  return chunks;
}

/** Writes a safetensors file atomically (see writeFileAtomic), streaming the tensors' own memory. */
export function writeSafetensors(path: string, tensors: ReadonlyMap<string, Tensor>, metadata?: Readonly<Record<string, string>>): void {
  writeFileAtomic(path, safetensorsChunks(tensors, metadata));
}

/** Reads a whole safetensors file; tensors are views on the file's bytes (see parseSafetensors). */
export function readSafetensors(path: string): SafetensorsContent {
  let bytes: Uint8Array;
  try {
    bytes = readFileSync(path);
  } catch (err) {
    throw ioError(err, path);
  }
  return parseSafetensors(bytes, path);
}

function bad(file: string | undefined, field: string, message: string): TreepackError {
  return new TreepackError('E_INPUT', message, file === undefined ? { field } : { file, field });
}

function isPlainObject(v: unknown): v is Record<string, unknown> {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

/**
 * Parses safetensors bytes. Every tensor is a zero-copy view on `bytes` when its start is aligned to its
 * element size, else a copy; views keep the whole buffer alive. Any inconsistency is an E_INPUT naming the
 * tensor (`field`), or `__header__` for the header itself.
 */
export function parseSafetensors(bytes: Uint8Array, file?: string): SafetensorsContent {
  assertLittleEndian();
  const HEADER = '__header__';
  if (bytes.byteLength < 8) throw bad(file, HEADER, `file is ${bytes.byteLength} bytes, shorter than the 8-byte header length`);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const n64 = view.getBigUint64(0, true);
  if (n64 > BigInt(bytes.byteLength - 8)) {
    throw bad(file, HEADER, `header length ${n64} runs past the end of the file (${bytes.byteLength - 8} bytes after the length)`);
  }
  const n = Number(n64);
  let header: unknown;
  try {
    header = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(bytes.subarray(8, 8 + n)));
  } catch (err) {
    throw bad(file, HEADER, `header is not valid UTF-8 JSON: ${(err as Error).message}`);
  }
  if (!isPlainObject(header)) throw bad(file, HEADER, 'header is not a JSON object');

  const metadata: Record<string, string> = {};
  const rawMeta = header[METADATA_KEY];
  if (rawMeta !== undefined && rawMeta !== null) {
    if (!isPlainObject(rawMeta)) throw bad(file, METADATA_KEY, `${METADATA_KEY} is not an object`);
    for (const [k, v] of Object.entries(rawMeta)) {
      if (typeof v !== 'string') throw bad(file, k, `metadata value ${JSON.stringify(k)} is not a string`);
      metadata[k] = v;
    }
  }

  const dataStart = 8 + n;
  const dataLen = bytes.byteLength - dataStart;
  const spans: { name: string; begin: number; end: number }[] = [];
  const tensors = new Map<string, Tensor>();
  for (const [name, info] of Object.entries(header)) {
    if (name === METADATA_KEY) continue;
    if (!isPlainObject(info)) throw bad(file, name, `tensor ${JSON.stringify(name)}: entry is not an object`);
    const { dtype, shape, data_offsets } = info;
    if (!isDtype(dtype)) throw bad(file, name, `tensor ${JSON.stringify(name)}: unknown dtype ${JSON.stringify(dtype)}`);
    const count = numel(shape);
    if (count < 0)
      throw bad(file, name, `tensor ${JSON.stringify(name)}: shape ${JSON.stringify(shape)} is not a list of non-negative integers`);
    if (
      !Array.isArray(data_offsets) ||
      data_offsets.length !== 2 ||
      !data_offsets.every((x) => Number.isSafeInteger(x) && x >= 0) ||
      data_offsets[0] > data_offsets[1]
    ) {
      throw bad(
        file,
        name,
        `tensor ${JSON.stringify(name)}: data_offsets ${JSON.stringify(data_offsets)} is not [begin, end] with 0 <= begin <= end`,
      );
    }
    const [begin, end] = data_offsets as number[];
    if (end > dataLen) {
      throw bad(
        file,
        name,
        `tensor ${JSON.stringify(name)}: data_offsets [${begin}, ${end}] run past the end of the data (${dataLen} bytes; file truncated?)`,
      );
    }
    const size = dtypeSize(dtype);
    if (end - begin !== count * size) {
      throw bad(
        file,
        name,
        `tensor ${JSON.stringify(name)}: shape ${JSON.stringify(shape)} of ${dtype} needs ${count * size} bytes but data_offsets span ${end - begin}`,
      );
    }
    spans.push({ name, begin, end });
    const ctor: ArrayCtor = DTYPES[dtype];
    const at = bytes.byteOffset + dataStart + begin;
    let data: TypedArray;
    if (at % size === 0) {
      data = new ctor(bytes.buffer, at, count);
    } else {
      data = new ctor(count);
      new Uint8Array(data.buffer).set(bytes.subarray(dataStart + begin, dataStart + end));
    }
    tensors.set(name, { dtype, shape: shape as number[], data });
  }
  spans.sort((a, b) => a.begin - b.begin || a.end - b.end);
  for (let k = 1; k < spans.length; k++) {
    const prev = spans[k - 1],
      cur = spans[k];
    if (cur.begin < prev.end) {
      throw bad(
        file,
        cur.name,
        `tensor ${JSON.stringify(cur.name)}: data_offsets [${cur.begin}, ${cur.end}] overlap tensor ${JSON.stringify(prev.name)} [${prev.begin}, ${prev.end}]`,
      );
    }
  }
  return { tensors, metadata };
}
