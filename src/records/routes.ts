/**
 * The one parser of a record's `routes`: the experts an MoE inference engine routed each token to, for routing
 * replay. Two spellings are read, both [T, layers, k] with T = the sequence's tokens or one fewer (vLLM routes
 * seq_len − 1 tokens: the last generated token is never fed back, so it has no route):
 *
 * - compact: `{"dtype": "uint8" | "int16" | "int32", "shape": [T, layers, k], "data": "<base64, little-endian>"}`
 *   (SGLang returns its routed experts as base64 int32);
 * - nested JSON: `[[[e, ...] × layers] × T]` (vLLM's `routed_experts` written as JSON).
 *
 * The gateway checks the routes it records with this too, so both paths refuse the same inputs, each with an
 * E_INPUT TreepackError naming the record and field (`routes`, `routes.shape`, `routes[t][l]`, ...).
 */
import { TreepackError, describeValue, type ErrorWhere } from '../errors.js';
import type { Routes } from './types.js';

/** Experts are stored as int16 (the micro-batch's `routes` tensor): the largest MoE models have a few hundred. */
export const MAX_EXPERT = 0x7fff;

const DTYPE_BYTES = { uint8: 1, int16: 2, int32: 4 } as const;
type RoutesDtype = keyof typeof DTYPE_BYTES;

/**
 * Standard base64 with its padding: Buffer.from would skip foreign characters silently. One scan for a foreign
 * character, then where `=` stands: a regex of repeated 4-character groups backtracks, taking seconds and then
 * overflowing the stack on routes of a long call (tens of MiB).
 */
function isBase64(s: string): boolean {
  if (s.length % 4 !== 0 || /[^A-Za-z0-9+/=]/.test(s)) return false;
  const eq = s.indexOf('=');
  return eq < 0 || (eq >= s.length - 2 && s.endsWith('='.repeat(s.length - eq)));
}

/**
 * `value` (a record's routes field, either spelling) as Routes over `tokens` tokens; a T of tokens − 1 leaves the
 * last token unrouted (−1). `where` locates the record, `field` is the field's path in it (`response.routes` for a
 * chat response).
 */
export function parseRoutes(value: unknown, tokens: number, where: ErrorWhere, field = 'routes'): Routes {
  const fail = (sub: string, msg: string): TreepackError => new TreepackError('E_INPUT', msg, { ...where, field: field + sub });
  if (Array.isArray(value)) return parseNested(value, tokens, fail);
  if (typeof value === 'object' && value !== null) return parseCompact(value as Record<string, unknown>, tokens, fail);
  throw fail(
    '',
    `expected {"dtype", "shape": [T, layers, k], "data": base64} or a nested array [T][layers][k] of expert ids, got ${describeValue(value)}`,
  );
}

type Fail = (sub: string, msg: string) => TreepackError;

function checkRows(rows: number, tokens: number, fail: Fail, sub: string): void {
  if (rows !== tokens && rows !== tokens - 1)
    throw fail(sub, `expected routes for ${tokens} tokens (or ${tokens - 1}: the last token unrouted), got ${rows}`);
}

function parseCompact(o: Record<string, unknown>, tokens: number, fail: Fail): Routes {
  const dtype = o.dtype;
  if (typeof dtype !== 'string' || !(dtype in DTYPE_BYTES))
    throw fail('.dtype', `expected "uint8", "int16" or "int32", got ${describeValue(dtype)}`);
  const shape = o.shape;
  if (!Array.isArray(shape) || shape.length !== 3) throw fail('.shape', `expected [T, layers, k], got ${describeValue(shape)}`);
  for (let i = 0; i < 3; i++) {
    const x: unknown = shape[i];
    if (typeof x !== 'number' || !Number.isInteger(x) || x < (i === 0 ? 0 : 1) || x > 0x7fffffff)
      throw fail(`.shape[${i}]`, `expected ${i === 0 ? 'a non-negative' : 'a positive'} integer, got ${describeValue(x)}`);
  }
  const [rows, layers, topK] = shape as number[];
  checkRows(rows, tokens, fail, '.shape[0]');
  const data = o.data;
  if (typeof data !== 'string' || !isBase64(data))
    throw fail('.data', `expected standard base64 (A-Z a-z 0-9 + /, = padded), got ${describeValue(data)}`);
  const bytes = DTYPE_BYTES[dtype as RoutesDtype];
  const count = rows * layers * topK;
  const buf = Buffer.from(data, 'base64');
  if (buf.length !== count * bytes)
    throw fail('.data', `shape [${rows}, ${layers}, ${topK}] of ${dtype} needs ${count * bytes} bytes, the base64 holds ${buf.length}`);
  const view = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
  const out = allocate(tokens, layers, topK);
  const e = out.experts;
  for (let i = 0; i < count; i++) {
    const x = bytes === 1 ? view.getUint8(i) : bytes === 2 ? view.getInt16(2 * i, true) : view.getInt32(4 * i, true);
    if (x < 0 || x > MAX_EXPERT) throw fail(slot(i, layers, topK), expertRange(x));
    e[i] = x;
  }
  checkDistinct(out, rows, fail);
  return out;
}

function parseNested(v: unknown[], tokens: number, fail: Fail): Routes {
  checkRows(v.length, tokens, fail, '');
  const first: unknown = v[0];
  if (v.length === 0) throw fail('', 'an empty array does not say how many layers and experts per token: use {"dtype", "shape", "data"}');
  if (!Array.isArray(first) || first.length === 0) throw fail('[0]', `expected a non-empty array of layers, got ${describeValue(first)}`);
  const second: unknown = first[0];
  if (!Array.isArray(second) || second.length === 0)
    throw fail('[0][0]', `expected a non-empty array of expert ids, got ${describeValue(second)}`);
  const layers = first.length;
  const topK = second.length;
  const out = allocate(tokens, layers, topK);
  const e = out.experts;
  for (let t = 0; t < v.length; t++) {
    const row: unknown = v[t];
    if (!Array.isArray(row) || row.length !== layers)
      throw fail(`[${t}]`, `expected an array of ${layers} layers (as token 0 has), got ${describeValue(row)}`);
    for (let l = 0; l < layers; l++) {
      const ks: unknown = row[l];
      if (!Array.isArray(ks) || ks.length !== topK)
        throw fail(`[${t}][${l}]`, `expected an array of ${topK} expert ids (as token 0 has), got ${describeValue(ks)}`);
      const base = (t * layers + l) * topK;
      for (let j = 0; j < topK; j++) {
        const x: unknown = ks[j];
        if (typeof x !== 'number' || !Number.isInteger(x) || x < 0 || x > MAX_EXPERT)
          throw fail(`[${t}][${l}][${j}]`, typeof x === 'number' ? expertRange(x) : `expected an expert id, got ${describeValue(x)}`);
        e[base + j] = x;
      }
    }
  }
  checkDistinct(out, v.length, fail);
  return out;
}

/** Routes over `tokens` tokens, all unrouted (−1) until filled. */
function allocate(tokens: number, layers: number, topK: number): Routes {
  return { layers, topK, experts: new Int16Array(tokens * layers * topK).fill(-1) };
}

function slot(i: number, layers: number, topK: number): string {
  const j = i % topK;
  const l = Math.floor(i / topK) % layers;
  return `[${Math.floor(i / (topK * layers))}][${l}][${j}]`;
}

function expertRange(x: number): string {
  return `expected an expert id (an integer in 0..${MAX_EXPERT}), got ${x}`;
}

/** The top-k of one token at one layer are k different experts: a repeat is a corrupt record, not a route. */
function checkDistinct(r: Routes, rows: number, fail: Fail): void {
  const { layers, topK, experts } = r;
  for (let row = 0; row < rows * layers; row++) {
    const base = row * topK;
    for (let j = 1; j < topK; j++)
      for (let i = 0; i < j; i++)
        if (experts[base + i] === experts[base + j])
          throw fail(
            `[${Math.floor(row / layers)}][${row % layers}]`,
            `expert ${experts[base + j]} is routed twice (top-k slots ${i} and ${j}): the top-k experts of a token differ`,
          );
  }
}
