/**
 * The experts an MoE engine routed each token to, as engines return them (routing replay, R3), made into the
 * record form the packer reads (`response.routes`, a sample's `routes`: src/records/routes.ts).
 *
 * What engines send on their OpenAI endpoints (each started with `--enable-return-routed-experts`):
 *  - vLLM: `choices[k].routed_experts`, base64 of a NumPy `.npy` file ([prompt + generated − 1, layers, k], int32
 *    in current versions, int16 before; non-streamed answers only), nothing to ask in the request; vLLM 0.21 split
 *    it into a top-level `prompt_routed_experts` (prompt rows) and `choices[k].routed_experts` (generated rows);
 *  - SGLang: `choices[k].sgl_ext.routed_experts` (earlier `choices[k].routed_experts`), asked with
 *    `return_routed_experts: true`: base64 of flat little-endian int32, [prompt + generated − 1, layers, k] with
 *    no shape on the wire, so layers and k come from `--route-shape`;
 *  - either as JSON: a nested array [T][layers][k], or the record's own `{"dtype", "shape", "data"}`.
 * Every form ends in one check: the shared record parser (`parseRoutes`) over the call's prompt and generated
 * tokens, so a route the gateway records is one `treepack pack` accepts.
 */
import { endianness } from 'node:os';
import { TreepackError } from '../errors.js';
import { parseRoutes } from '../records/routes.js';

type Obj = Record<string, unknown>;
const isObj = (v: unknown): v is Obj => typeof v === 'object' && v !== null && !Array.isArray(v);

/** How the gateway records routes (`--record-routes`, `--route-shape`, `--max-route-bytes`). */
export interface RouteOptions {
  /** layers and experts per token, for engines that send a flat array (SGLang) */
  shape?: readonly [layers: number, topK: number];
  /** the most int16 bytes one output's routes may take; more are not recorded */
  maxBytes: number;
}

/** Routes as a call records them: the compact record form, int16, one row per token the engine routed. */
export interface RecordedRoutes {
  dtype: 'int16';
  shape: [tokens: number, layers: number, topK: number];
  data: string;
}

/** One output's routes as the engine sent them, with the fields they came from. */
export interface RawRoutes {
  value: unknown;
  field: string;
  /** vLLM 0.21: the prompt's rows, apart (top-level `prompt_routed_experts`) */
  prompt?: { value: unknown; field: string };
}

/** Why an output's routes were not recorded (the call is: answered and recorded without them). */
export type DropReason = 'invalid' | 'length' | 'too_large' | 'no_shape' | 'untokenized';

export class RoutesDropped extends Error {
  constructor(
    readonly reason: DropReason,
    readonly field: string,
    readonly detail: string,
  ) {
    super(`field ${JSON.stringify(field)}: ${detail}`);
  }
}

const present = (v: unknown) => v !== undefined && v !== null;

/** The routes a choice of a response (or of a stream chunk) carries, if any. */
export function choiceRoutes(json: Obj, c: Obj, at: string): RawRoutes | undefined {
  let raw: RawRoutes | undefined;
  if (present(c.routed_experts)) raw = { value: c.routed_experts, field: `${at}.routed_experts` };
  else if (isObj(c.sgl_ext) && present(c.sgl_ext.routed_experts))
    raw = { value: c.sgl_ext.routed_experts, field: `${at}.sgl_ext.routed_experts` };
  if (raw && present(json.prompt_routed_experts)) raw.prompt = { value: json.prompt_routed_experts, field: 'prompt_routed_experts' };
  return raw;
}

/** Takes the routes fields out of an answer (or chunk) the client did not ask them for (in place). */
export function stripRoutes(json: Obj): void {
  delete json.prompt_routed_experts;
  if (!Array.isArray(json.choices)) return;
  for (const c of json.choices) {
    if (!isObj(c)) continue;
    delete c.routed_experts;
    if (isObj(c.sgl_ext)) {
      delete c.sgl_ext.routed_experts;
      if (Object.keys(c.sgl_ext).length === 0) delete c.sgl_ext;
    }
  }
}

interface Decoded {
  rows: number;
  layers: number;
  topK: number;
  values: Int32Array;
}

/**
 * The routes of one output over its `tokens` (prompt and generated), in the record form; throws RoutesDropped
 * saying why they cannot be recorded.
 */
export function recordRoutes(raw: RawRoutes, tokens: number | undefined, opts: RouteOptions): RecordedRoutes {
  if (tokens === undefined)
    throw new RoutesDropped('untokenized', raw.field, 'the engine returned no token ids for this output: its routes cannot be aligned');
  const gen = decode(raw.value, raw.field, opts);
  let all = gen;
  if (raw.prompt) {
    const p = decode(raw.prompt.value, raw.prompt.field, opts);
    if (p.layers !== gen.layers || p.topK !== gen.topK)
      throw new RoutesDropped(
        'invalid',
        raw.field,
        `[${gen.layers}, ${gen.topK}] layers and experts per token, the prompt's (${raw.prompt.field}) [${p.layers}, ${p.topK}]`,
      );
    const values = new Int32Array(p.values.length + gen.values.length);
    values.set(p.values);
    values.set(gen.values, p.values.length);
    all = { rows: p.rows + gen.rows, layers: gen.layers, topK: gen.topK, values };
  }
  const bytes = all.values.length * 2;
  if (bytes > opts.maxBytes)
    throw new RoutesDropped(
      'too_large',
      raw.field,
      `${all.rows} tokens × ${all.layers} layers × ${all.topK} experts take ${bytes} bytes as int16, over --max-route-bytes ${opts.maxBytes}`,
    );
  const int16 = new Int16Array(all.values.length);
  for (let i = 0; i < int16.length; i++) {
    const x = all.values[i];
    // out of int16: left for parseRoutes to name (as −1, never a valid expert)
    int16[i] = x >= 0 && x <= 0x7fff ? x : -1;
  }
  const rec: RecordedRoutes = {
    dtype: 'int16',
    shape: [all.rows, all.layers, all.topK],
    data: Buffer.from(int16.buffer, int16.byteOffset, int16.byteLength).toString('base64'),
  };
  try {
    parseRoutes(rec, tokens, {}, raw.field); // the record parser's checks: rows, expert range, distinct top-k
  } catch (err) {
    if (!(err instanceof TreepackError)) throw err;
    const reason = all.rows !== tokens && all.rows !== tokens - 1 ? 'length' : 'invalid';
    throw new RoutesDropped(reason, err.where.field ?? raw.field, valueOutOfRange(err.detail, all.values));
  }
  return rec;
}

/** parseRoutes saw −1 where the engine sent a value int16 cannot hold: name that value instead. */
function valueOutOfRange(detail: string, values: Int32Array): string {
  if (!detail.endsWith('got -1')) return detail;
  const bad = values.find((x) => x < 0 || x > 0x7fff);
  return bad === undefined ? detail : detail.replace(/got -1$/, `got ${bad}`);
}

function decode(value: unknown, field: string, opts: RouteOptions): Decoded {
  if (typeof value === 'string') return decodeBase64(value, field, opts);
  if (Array.isArray(value) || isObj(value)) {
    // JSON forms: the record parser reads them as they are, over the rows they hold
    const rows = Array.isArray(value) ? value.length : Array.isArray(value.shape) ? (value.shape[0] as number) : 0;
    try {
      const r = parseRoutes(value, rows, {}, field);
      return { rows, layers: r.layers, topK: r.topK, values: Int32Array.from(r.experts) };
    } catch (err) {
      if (!(err instanceof TreepackError)) throw err;
      throw new RoutesDropped('invalid', err.where.field ?? field, err.detail);
    }
  }
  throw new RoutesDropped('invalid', field, `expected base64 (a NumPy array, or flat int32) or a nested array, got ${typeof value}`);
}

const BASE64 = /^[A-Za-z0-9+/]*={0,2}$/;
const NPY_MAGIC = Buffer.from([0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59]); // \x93NUMPY

function decodeBase64(s: string, field: string, opts: RouteOptions): Decoded {
  // a payload that cannot fit the bound as int16 even from int32 is refused before it is decoded
  if (s.length > 4 * opts.maxBytes + 1024)
    throw new RoutesDropped('too_large', field, `${s.length} characters of base64, over --max-route-bytes ${opts.maxBytes}`);
  if (s.length % 4 !== 0 || !BASE64.test(s)) throw new RoutesDropped('invalid', field, 'expected standard base64');
  const buf = Buffer.from(s, 'base64');
  if (buf.subarray(0, 6).equals(NPY_MAGIC)) return decodeNpy(buf, field);
  // SGLang: flat int32, its shape given by the operator
  if (!opts.shape)
    throw new RoutesDropped(
      'no_shape',
      field,
      'a flat array of expert ids (SGLang) does not say its layers and experts per token: start the service with --route-shape LAYERS,TOPK',
    );
  const [layers, topK] = opts.shape;
  if (buf.length % (4 * layers * topK) !== 0)
    throw new RoutesDropped(
      'invalid',
      field,
      `${buf.length} bytes are no whole number of int32 rows of [${layers}, ${topK}] (--route-shape)`,
    );
  const values = int32s(buf, 0, buf.length / 4);
  return { rows: values.length / (layers * topK), layers, topK, values };
}

const NPY_READ: Record<string, [bytes: number, read: (b: Buffer, at: number) => number]> = {
  '|u1': [1, (b, at) => b.readUInt8(at)],
  '|i1': [1, (b, at) => b.readInt8(at)],
  '<u2': [2, (b, at) => b.readUInt16LE(at)],
  '<i2': [2, (b, at) => b.readInt16LE(at)],
  '<u4': [4, (b, at) => b.readUInt32LE(at)],
  '<i4': [4, (b, at) => b.readInt32LE(at)],
  '<i8': [8, (b, at) => Number(b.readBigInt64LE(at))],
};

/** A NumPy .npy file (format versions 1 to 3): a 3-D integer array in C order. */
function decodeNpy(buf: Buffer, field: string): Decoded {
  const bad = (msg: string) => new RoutesDropped('invalid', field, `a NumPy array ${msg}`);
  if (buf.length < 10) throw bad('cut short');
  const major = buf[6];
  const wide = major >= 2;
  const headerLen = wide ? buf.readUInt32LE(8) : buf.readUInt16LE(8);
  const start = (wide ? 12 : 10) + headerLen;
  if (buf.length < start) throw bad('cut short in its header');
  const header = buf.toString('latin1', wide ? 12 : 10, start);
  let descr = /'descr':\s*'([^']*)'/.exec(header)?.[1];
  if (descr !== undefined) descr = descr.replace(/^=/, '<').replace(/^[<|]([iu]1)$/, '|$1');
  const read = descr === undefined ? undefined : NPY_READ[descr];
  if (!read) throw bad(`of dtype ${JSON.stringify(descr ?? null)}: expected little-endian integers`);
  if (!/'fortran_order':\s*False/.test(header)) throw bad('in Fortran order: expected C order');
  const dims = /'shape':\s*\(([^)]*)\)/
    .exec(header)?.[1]
    .split(',')
    .map((x) => x.trim())
    .filter((x) => x !== '')
    .map(Number);
  if (!dims || dims.length !== 3 || !dims.every((d) => Number.isSafeInteger(d) && d >= 0))
    throw bad(`of shape (${dims?.join(', ') ?? '?'}): expected [tokens, layers, experts per token]`);
  const [rows, layers, topK] = dims;
  const [size, get] = read;
  const count = rows * layers * topK;
  if (buf.length - start !== count * size)
    throw bad(`of shape (${dims.join(', ')}) needs ${count * size} bytes, has ${buf.length - start}`);
  if (descr === '<i4') return { rows, layers, topK, values: int32s(buf, start, count) };
  const values = new Int32Array(count);
  for (let i = 0; i < count; i++) {
    const x = get(buf, start + i * size);
    values[i] = x >= -0x80000000 && x <= 0x7fffffff ? x : -1;
  }
  return { rows, layers, topK, values };
}

const LITTLE_ENDIAN = endianness() === 'LE';

/** `count` little-endian int32 at `at` in `buf`: one copy (aligned) on a little-endian host, not a read per value. */
function int32s(buf: Buffer, at: number, count: number): Int32Array {
  if (LITTLE_ENDIAN) return new Int32Array(buf.buffer.slice(buf.byteOffset + at, buf.byteOffset + at + 4 * count));
  const values = new Int32Array(count);
  for (let i = 0; i < count; i++) values[i] = buf.readInt32LE(at + 4 * i);
  return values;
}
