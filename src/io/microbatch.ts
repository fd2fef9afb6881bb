/**
 * Packed micro-batch files (docs/design.md §3): one safetensors file per micro-batch, tensors and
 * `__metadata__` named exactly as the contract. Tensors outside the contract (mask lowerings and the like) travel
 * alongside as `extra`, untouched.
 *
 * Both directions check the same shape rules: every contract tensor 1-D with its dtype and length, the metadata
 * numbers equal to those lengths, `seq_offsets` a CSR offset array ending at M. Reading reports E_INPUT naming
 * the file and tensor/field; writing reports E_ARG before anything touches the disk. The deeper forest
 * invariants (docs/design.md §7) are `checkForest` in src/pack/invariants.ts, which costs a pass over the data.
 */
import { argError, TreepackError } from '../errors.js';
import {
  FORMAT,
  IMAGE_FIELDS,
  MAX_TOKENS,
  NODE_FIELDS,
  OCCURRENCE_FLOAT_FIELDS,
  OPTIONAL_OCCURRENCE_FIELDS,
  type MicroBatch,
  type MicroBatchMeta,
} from '../pack/contract.js';
import { readSafetensors, safetensorsChunks, writeSafetensors, type Dtype, type Tensor, type TypedArray } from './safetensors.js';
import type { ExtraTensors } from './sink.js';

const META_NUMBERS = ['num_sequences', 'num_tokens_naive', 'num_tokens_packed'] as const;

/** Contract tensors and their dtypes; OPTIONAL ones may be absent. */
const CONTRACT_DTYPES: ReadonlyMap<string, Dtype> = new Map<string, Dtype>([
  ...NODE_FIELDS.map((f) => [f, 'I32'] as const),
  ['seq_offsets', 'I32'],
  ['seq_positions', 'I32'],
  ['loss_mask', 'U8'],
  ...OCCURRENCE_FLOAT_FIELDS.map((f) => [f, 'F32'] as const),
  ['turn_ids', 'I32'],
]);
const OPTIONAL: ReadonlySet<string> = new Set(OPTIONAL_OCCURRENCE_FIELDS);

/** A micro-batch file as read: the contract arrays, and the tensors and header keys outside the contract. */
export interface MicroBatchFile {
  batch: MicroBatch;
  extra: Map<string, Tensor>;
  /** Header metadata outside the contract (e.g. `block_size` beside a block mask), as written. */
  extraMeta: Record<string, string>;
}

/** Header keys the contract owns; extra metadata must use others. */
const PREFIX_META_KEYS = ['prefix_tokens', 'prefix_push', 'prefix_release', 'prefix_shared', 'cp_ranks'] as const;
/** The routing-replay extension: tensor `routes` I16 [N, routes_layers, routes_top_k], both keys with it. */
const ROUTES = 'routes';
const ROUTES_META_KEYS = ['routes_layers', 'routes_top_k'] as const;
const CONTRACT_META_KEYS = new Set<string>([
  'format',
  ...META_NUMBERS,
  'tokenizer',
  'sequence_ids',
  'num_pad_tokens',
  'vocab_size',
  ...PREFIX_META_KEYS,
  ...ROUTES_META_KEYS,
  'image_processor',
  'image_hashes',
]);
const IMAGE_NAMES = Object.keys(IMAGE_FIELDS) as (keyof typeof IMAGE_FIELDS)[];

/**
 * The image extension: all five tensors and both header keys, or none; shapes from I (hashes), F, N and the pixel
 * bytes the sizes add up to. Returns each tensor's shape for the writer.
 */
function checkImages(mb: MicroBatch, fail: Fail): Map<string, number[]> | undefined {
  const present = IMAGE_NAMES.filter((f) => mb[f] !== undefined);
  const hashes = mb.meta.image_hashes;
  if (present.length === 0 && hashes === undefined && mb.meta.image_processor === undefined) return undefined;
  const missing = IMAGE_NAMES.find((f) => mb[f] === undefined);
  if (missing) throw fail(missing, `${missing} is missing: the image tensors (${IMAGE_NAMES.join(', ')}) go together`);
  if (!Array.isArray(hashes) || !hashes.every((h) => typeof h === 'string'))
    throw fail('image_hashes', 'image_hashes must be a list of strings, one per image');
  const p = mb.meta.image_processor;
  if (p === null || typeof p !== 'object' || !Number.isSafeInteger(p.image_token_id))
    throw fail('image_processor', 'image_processor must be an object with the processor settings (image_token_id, ...)');
  const I = hashes.length;
  const sizes = mb.image_sizes!;
  if (sizes.length !== 2 * I) throw fail('image_sizes', `image_sizes has ${sizes.length} elements, expected [I = ${I}, 2]`);
  let B = 0;
  for (let i = 0; i < I; i++) B += 3 * sizes[2 * i] * sizes[2 * i + 1];
  const fills = mb.image_fills!;
  if (fills.length % 4 !== 0) throw fail('image_fills', `image_fills has ${fills.length} elements, expected [F, 4]`);
  const dims = { I, F: fills.length / 4, N: mb.input_ids.length, B };
  const shapes = new Map<string, number[]>();
  for (const f of IMAGE_NAMES) {
    const shape = IMAGE_FIELDS[f][1](dims);
    const n = shape[0] * (shape[1] ?? 1);
    if (mb[f]!.length !== n) throw fail(f, `${f} has ${mb[f]!.length} elements, expected shape ${JSON.stringify(shape)}`);
    shapes.set(f, shape);
  }
  for (let k = 0; k < dims.F; k++) {
    const [i, pos, first, count] = fills.subarray(4 * k, 4 * k + 4);
    const tokens = (mb.image_grid_thw![3 * i] * mb.image_grid_thw![3 * i + 1] * mb.image_grid_thw![3 * i + 2]) / Number(p.merge_size) ** 2;
    if (!(i >= 0 && i < I && pos >= 0 && count >= 1 && pos + count <= dims.N && first >= 0 && first + count <= tokens))
      throw fail('image_fills', `image_fills[${k}] = [${i}, ${pos}, ${first}, ${count}] is outside the images or the nodes`);
  }
  return shapes;
}

type Fail = (field: string, message: string) => TreepackError;

/** Shape rules shared by reader and writer; `fail` decides the error code and location. */
function checkShapes(mb: MicroBatch, fail: Fail): void {
  if (mb.meta.format !== FORMAT) throw fail('format', `format is ${JSON.stringify(mb.meta.format)}, expected ${JSON.stringify(FORMAT)}`);
  const N = mb.input_ids.length;
  const M = mb.seq_positions.length;
  const S = mb.seq_offsets.length - 1;
  if (N > MAX_TOKENS || M > MAX_TOKENS) throw fail(N > MAX_TOKENS ? 'input_ids' : 'seq_positions', `more than ${MAX_TOKENS} tokens`);
  if (S < 0) throw fail('seq_offsets', 'seq_offsets is empty; it needs S+1 >= 1 entries');
  for (const f of NODE_FIELDS) {
    if (mb[f].length !== N) throw fail(f, `${f} has ${mb[f].length} elements but input_ids has N = ${N}`);
  }
  for (const f of ['loss_mask', ...OPTIONAL_OCCURRENCE_FIELDS] as const) {
    const a = mb[f];
    if (a !== undefined && a.length !== M) throw fail(f, `${f} has ${a.length} elements but seq_positions has M = ${M}`);
  }
  const pad = mb.meta.num_pad_tokens;
  if (pad !== undefined && !(Number.isSafeInteger(pad) && pad >= 0 && pad <= N))
    throw fail('num_pad_tokens', `num_pad_tokens = ${pad}, expected an integer in [0, N = ${N}]`);
  const vocab = mb.meta.vocab_size;
  if (vocab !== undefined && !(Number.isSafeInteger(vocab) && vocab >= 1))
    throw fail('vocab_size', `vocab_size = ${vocab}, expected an integer >= 1`);
  checkPrefix(mb, fail);
  checkCpRanks(mb, fail);
  checkRoutes(mb, fail);
  checkImages(mb, fail);
  const shapes = { num_sequences: S, num_tokens_naive: M, num_tokens_packed: N };
  for (const key of META_NUMBERS) {
    if (mb.meta[key] !== shapes[key]) throw fail(key, `${key} = ${mb.meta[key]} but the tensors say ${shapes[key]}`);
  }
  if (
    !Array.isArray(mb.meta.sequence_ids) ||
    mb.meta.sequence_ids.length !== S ||
    !mb.meta.sequence_ids.every((id) => typeof id === 'string')
  ) {
    throw fail('sequence_ids', `sequence_ids must be a list of ${S} strings`);
  }
  if (typeof mb.meta.tokenizer !== 'string') throw fail('tokenizer', 'tokenizer must be a string');
  const off = mb.seq_offsets;
  if (off[0] !== 0) throw fail('seq_offsets', `seq_offsets[0] = ${off[0]}, expected 0`);
  for (let i = 0; i < S; i++) {
    if (off[i + 1] < off[i]) throw fail('seq_offsets', `seq_offsets decreases at ${i + 1}: ${off[i]} > ${off[i + 1]}`);
  }
  if (off[S] !== M) throw fail('seq_offsets', `seq_offsets[S] = ${off[S]} but seq_positions has M = ${M} elements`);
}

/** The step-plan extension: all three keys or none; the chain within the forest; push ends ascending, ending at prefix_tokens. */
function checkPrefix(mb: MicroBatch, fail: Fail): void {
  const { prefix_tokens: h, prefix_push: push, prefix_release: release } = mb.meta;
  const given = [h, push, release].filter((v) => v !== undefined).length;
  if (given === 0 && mb.meta.prefix_shared !== undefined)
    throw fail('prefix_shared', 'prefix_shared needs prefix_tokens, prefix_push and prefix_release (a step plan entry)');
  if (given === 0) return;
  if (given !== 3) throw fail('prefix_tokens', 'prefix_tokens, prefix_push and prefix_release go together (a step plan entry)');
  const N = mb.input_ids.length;
  if (!(Number.isSafeInteger(h) && h! >= 0 && h! <= N))
    throw fail('prefix_tokens', `prefix_tokens = ${h}, expected an integer in [0, N = ${N}]`);
  if (!(Number.isSafeInteger(release) && release! >= 0))
    throw fail('prefix_release', `prefix_release = ${release}, expected an integer >= 0`);
  const ok =
    Array.isArray(push) &&
    push.every((e, k) => Number.isSafeInteger(e) && e > (k ? push[k - 1] : 0)) &&
    (push.length === 0 || push[push.length - 1] === h);
  if (!ok) throw fail('prefix_push', `prefix_push = ${JSON.stringify(push)}, expected ascending depths ending at prefix_tokens = ${h}`);
  const shared = mb.meta.prefix_shared;
  if (
    shared !== undefined &&
    !(Array.isArray(shared) && shared.length === push.length && shared.every((x) => x === null || (Number.isSafeInteger(x) && x >= 0)))
  )
    throw fail(
      'prefix_shared',
      `prefix_shared = ${JSON.stringify(shared)}, expected one piece id (an integer >= 0) or null per prefix_push entry`,
    );
}

/** The context-parallel extension: two or more ranks, ascending. */
function checkCpRanks(mb: MicroBatch, fail: Fail): void {
  const r = mb.meta.cp_ranks;
  if (r === undefined) return;
  if (!(Array.isArray(r) && r.length >= 2 && r.every((x, k) => Number.isSafeInteger(x) && x >= 0 && (k === 0 || x > r[k - 1]))))
    throw fail('cp_ranks', `cp_ranks = ${JSON.stringify(r)}, expected two or more ascending rank numbers`);
}

/**
 * The routing-replay extension: `routes` with both shape keys or none of them, [N, layers, k] long, each node's row
 * either all −1 (no occurrence routed) or k distinct experts >= 0 per layer.
 */
function checkRoutes(mb: MicroBatch, fail: Fail): void {
  const { routes } = mb;
  const { routes_layers: L, routes_top_k: k } = mb.meta;
  if (routes === undefined && L === undefined && k === undefined) return;
  if (routes === undefined || L === undefined || k === undefined)
    throw fail(routes === undefined ? ROUTES : 'routes_layers', 'the routes tensor, routes_layers and routes_top_k go together');
  for (const [key, v] of [
    ['routes_layers', L],
    ['routes_top_k', k],
  ] as const)
    if (!(Number.isSafeInteger(v) && v >= 1)) throw fail(key, `${key} = ${v}, expected an integer >= 1`);
  const N = mb.input_ids.length;
  if (routes.length !== N * L * k)
    throw fail(ROUTES, `routes has ${routes.length} elements, expected N × routes_layers × routes_top_k = ${N * L * k}`);
  for (let p = 0; p < N; p++) {
    const row = routes.subarray(p * L * k, (p + 1) * L * k);
    if (row.every((e) => e === -1)) continue;
    for (let l = 0; l < L; l++)
      for (let j = 0; j < k; j++) {
        const e = row[l * k + j];
        if (e < 0)
          throw fail(
            ROUTES,
            `routes[${p}][${l}][${j}] = ${e}: a routed node needs an expert >= 0 in every slot (−1 only for a node no occurrence was routed at)`,
          );
        for (let i = 0; i < j; i++) if (row[l * k + i] === e) throw fail(ROUTES, `routes[${p}][${l}] holds expert ${e} twice`);
      }
  }
}

/**
 * Writes `batch` (and `extra` tensors and `extraMeta` header entries, under names outside the contract)
 * atomically. Typed arrays are streamed from their own memory, so a batch of hundreds of MB costs no second copy.
 */
export function writeMicroBatch(
  path: string,
  batch: MicroBatch,
  extra?: ReadonlyMap<string, Tensor>,
  extraMeta?: Readonly<Record<string, string>>,
): void {
  const { tensors, metadata } = fileContent(batch, extra, extraMeta, path);
  writeSafetensors(path, tensors, metadata);
}

/** The bytes `writeMicroBatch` writes for a micro-batch and its mask lowerings, for a caller that sends them elsewhere. */
export function microBatchBytes(mb: { batch: MicroBatch; masks?: ExtraTensors }): Uint8Array {
  const { tensors, metadata } = fileContent(mb.batch, mb.masks?.tensors, mb.masks?.metadata);
  return Buffer.concat(safetensorsChunks(tensors, metadata));
}

function fileContent(batch: MicroBatch, extra?: ReadonlyMap<string, Tensor>, extraMeta?: Readonly<Record<string, string>>, file?: string) {
  if (batch === null || typeof batch !== 'object' || batch.meta === null || typeof batch.meta !== 'object') {
    throw argError('batch', 'a MicroBatch', batch);
  }
  const tensors = new Map<string, Tensor>();
  for (const [name, dtype] of CONTRACT_DTYPES) {
    const data = batch[name as keyof MicroBatch] as TypedArray | undefined;
    if (data === undefined && OPTIONAL.has(name)) continue;
    const ctor = dtype === 'I32' ? Int32Array : dtype === 'U8' ? Uint8Array : Float32Array;
    if (!(data instanceof ctor)) throw argError(`batch.${name}`, `a ${ctor.name}`, data);
    tensors.set(name, { dtype, shape: [data.length], data });
  }
  if (batch.routes !== undefined && !(batch.routes instanceof Int16Array)) throw argError('batch.routes', 'an Int16Array', batch.routes);
  const argFail: Fail = (field, message) => new TreepackError('E_ARG', message, { file, field });
  checkShapes(batch, argFail);
  if (batch.routes)
    tensors.set(ROUTES, {
      dtype: 'I16',
      shape: [batch.input_ids.length, batch.meta.routes_layers!, batch.meta.routes_top_k!],
      data: batch.routes,
    });
  for (const [name, shape] of checkImages(batch, argFail) ?? []) {
    const data = batch[name as keyof typeof IMAGE_FIELDS]!;
    const ctor = IMAGE_FIELDS[name as keyof typeof IMAGE_FIELDS][0] === 'U8' ? Uint8Array : Int32Array;
    if (!(data instanceof ctor)) throw argError(`batch.${name}`, `a ${ctor.name}`, data);
    tensors.set(name, { dtype: IMAGE_FIELDS[name as keyof typeof IMAGE_FIELDS][0], shape, data });
  }
  for (const [name, t] of extra ?? []) {
    if (CONTRACT_DTYPES.has(name) || name === ROUTES || name in IMAGE_FIELDS)
      throw argError(`extra tensor name`, 'a name outside the micro-batch contract', name);
    tensors.set(name, t);
  }
  for (const [key, value] of Object.entries(extraMeta ?? {})) {
    if (CONTRACT_META_KEYS.has(key)) throw argError('extra metadata key', 'a key outside the micro-batch contract', key);
    if (typeof value !== 'string') throw argError(`extra metadata ${key}`, 'a string', value);
  }
  const m = batch.meta;
  const metadata: Record<string, string> = {
    ...extraMeta,
    format: m.format,
    num_sequences: String(m.num_sequences),
    num_tokens_naive: String(m.num_tokens_naive),
    num_tokens_packed: String(m.num_tokens_packed),
    tokenizer: m.tokenizer,
    sequence_ids: JSON.stringify(m.sequence_ids),
    ...(m.num_pad_tokens !== undefined ? { num_pad_tokens: String(m.num_pad_tokens) } : {}),
    ...(m.vocab_size !== undefined ? { vocab_size: String(m.vocab_size) } : {}),
    ...(m.prefix_tokens !== undefined
      ? { prefix_tokens: String(m.prefix_tokens), prefix_push: JSON.stringify(m.prefix_push), prefix_release: String(m.prefix_release) }
      : {}),
    ...(m.prefix_shared !== undefined ? { prefix_shared: JSON.stringify(m.prefix_shared) } : {}),
    ...(m.cp_ranks !== undefined ? { cp_ranks: JSON.stringify(m.cp_ranks) } : {}),
    ...(m.routes_layers !== undefined && { routes_layers: String(m.routes_layers), routes_top_k: String(m.routes_top_k) }),
    ...(m.image_hashes !== undefined
      ? { image_processor: JSON.stringify(m.image_processor), image_hashes: JSON.stringify(m.image_hashes) }
      : {}),
  };
  return { tensors, metadata };
}

/**
 * Reads a micro-batch file. Contract tensors are zero-copy views on the file's bytes when aligned (always, for
 * files this library writes). Metadata keys outside the contract come back in `extraMeta`.
 */
export function readMicroBatch(path: string): MicroBatchFile {
  const fail: Fail = (field, message) => new TreepackError('E_INPUT', message, { file: path, field });
  const { tensors, metadata } = readSafetensors(path);
  if (metadata.format !== FORMAT) {
    throw fail(
      'format',
      `format is ${metadata.format === undefined ? 'missing' : JSON.stringify(metadata.format)}, expected ${JSON.stringify(FORMAT)}`,
    );
  }
  const nums = {} as Record<(typeof META_NUMBERS)[number], number>;
  for (const key of META_NUMBERS) {
    const s = metadata[key];
    if (s === undefined || !/^(0|[1-9][0-9]*)$/.test(s) || !Number.isSafeInteger(Number(s))) {
      throw fail(key, `${key} is ${s === undefined ? 'missing' : JSON.stringify(s)}, expected a non-negative integer`);
    }
    nums[key] = Number(s);
  }
  if (metadata.tokenizer === undefined) throw fail('tokenizer', 'tokenizer is missing');
  let sequence_ids: unknown;
  try {
    sequence_ids = JSON.parse(metadata.sequence_ids ?? 'null');
  } catch {
    throw fail('sequence_ids', 'sequence_ids is not JSON');
  }
  const meta: MicroBatchMeta = { format: FORMAT, ...nums, tokenizer: metadata.tokenizer, sequence_ids: sequence_ids as string[] };
  const pad = metadata.num_pad_tokens;
  if (pad !== undefined) {
    if (!/^(0|[1-9][0-9]*)$/.test(pad))
      throw fail('num_pad_tokens', `num_pad_tokens is ${JSON.stringify(pad)}, expected a non-negative integer`);
    meta.num_pad_tokens = Number(pad);
  }
  const vocab = metadata.vocab_size;
  if (vocab !== undefined) {
    if (!/^[1-9][0-9]*$/.test(vocab)) throw fail('vocab_size', `vocab_size is ${JSON.stringify(vocab)}, expected a positive integer`);
    meta.vocab_size = Number(vocab);
  }
  for (const key of ROUTES_META_KEYS) {
    const v = metadata[key];
    if (v === undefined) continue;
    if (!/^[1-9][0-9]*$/.test(v)) throw fail(key, `${key} is ${JSON.stringify(v)}, expected a positive integer`);
    meta[key] = Number(v);
  }
  for (const key of ['prefix_tokens', 'prefix_release'] as const) {
    const v = metadata[key];
    if (v === undefined) continue;
    if (!/^(0|[1-9][0-9]*)$/.test(v)) throw fail(key, `${key} is ${JSON.stringify(v)}, expected a non-negative integer`);
    meta[key] = Number(v);
  }
  for (const key of ['prefix_push', 'prefix_shared', 'cp_ranks'] as const) {
    if (metadata[key] === undefined) continue;
    try {
      (meta as unknown as Record<string, unknown>)[key] = JSON.parse(metadata[key]);
    } catch {
      throw fail(key, `${key} is not JSON`);
    }
  }

  for (const key of ['image_processor', 'image_hashes'] as const) {
    const v = metadata[key];
    if (v === undefined) continue;
    try {
      (meta as unknown as Record<string, unknown>)[key] = JSON.parse(v);
    } catch {
      throw fail(key, `${key} is not JSON`);
    }
  }

  const fields: Record<string, TypedArray> = {};
  for (const name of IMAGE_NAMES) {
    const t = tensors.get(name);
    if (t === undefined) continue;
    if (t.dtype !== IMAGE_FIELDS[name][0]) throw fail(name, `tensor ${name} has dtype ${t.dtype}, expected ${IMAGE_FIELDS[name][0]}`);
    fields[name] = t.data;
  }
  for (const [name, dtype] of CONTRACT_DTYPES) {
    const t = tensors.get(name);
    if (t === undefined) {
      if (OPTIONAL.has(name)) continue;
      throw fail(name, `required tensor ${name} is missing`);
    }
    if (t.dtype !== dtype) throw fail(name, `tensor ${name} has dtype ${t.dtype}, expected ${dtype}`);
    if (t.shape.length !== 1) throw fail(name, `tensor ${name} has shape ${JSON.stringify(t.shape)}, expected 1-D`);
    fields[name] = t.data;
  }
  const batch = { ...fields, meta } as unknown as MicroBatch;
  const routes = tensors.get(ROUTES);
  if (routes !== undefined) {
    if (routes.dtype !== 'I16') throw fail(ROUTES, `tensor routes has dtype ${routes.dtype}, expected I16`);
    const want = [nums.num_tokens_packed, meta.routes_layers, meta.routes_top_k];
    if (JSON.stringify(routes.shape) !== JSON.stringify(want))
      throw fail(
        ROUTES,
        `tensor routes has shape ${JSON.stringify(routes.shape)}, expected [N, routes_layers, routes_top_k] = ${JSON.stringify(want)}`,
      );
    batch.routes = routes.data as Int16Array;
  }
  checkShapes(batch, fail);
  const extra = new Map([...tensors].filter(([name]) => !CONTRACT_DTYPES.has(name) && name !== ROUTES && !(name in IMAGE_FIELDS)));
  const extraMeta = Object.fromEntries(Object.entries(metadata).filter(([key]) => !CONTRACT_META_KEYS.has(key)));
  return { batch, extra, extraMeta };
}
