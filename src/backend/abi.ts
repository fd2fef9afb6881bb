/**
 * The tables the C ABI shares with every language, in one place: the loss config (field order, types, enum codes),
 * the loss metrics, the status codes of the CPU and CUDA C ABIs (with the TreepackError code each becomes), and the
 * constants the kernels restate. scripts/gen-abi.ts writes native/core/abi.h (C, C++, CUDA, the N-API bindings) and
 * python/treepack/_abi.py (ctypes) from them; the WGSL kernels and the addon glue read them here. test/abi.test.ts
 * fails when a generated file differs, and runs every field through every backend.
 *
 * `ABI_HASH` fingerprints the tables: each native library reports the hash it was built with (tp_abi), and a
 * loader refuses a build whose tables differ from these.
 */
import type { ErrorCode } from '../errors.js';
import { AGGREGATIONS, configCodes, KL_ESTIMATORS, POLICY_LOSSES, TIS_LEVELS, type LossConfig } from '../loss/config.js';
import { K3_LOG_CLAMP, K3_VALUE_CLAMP } from '../loss/kl.js';
import type { LossMetrics } from '../loss/types.js';

export interface EnumField {
  name: 'policy' | 'aggregation' | 'kl' | 'tis';
  /** Names in code order: the code of a name is its index. */
  names: readonly string[];
  /** C enum type and constant prefix. */
  cType: string;
  cPrefix: string;
}

/** tp_loss_config in field order: the enums as int32, then the numbers as double. */
export const LOSS_CONFIG_ENUMS: readonly EnumField[] = [
  { name: 'policy', names: POLICY_LOSSES, cType: 'tp_loss_policy', cPrefix: 'TP_POLICY' },
  { name: 'aggregation', names: AGGREGATIONS, cType: 'tp_loss_aggregation', cPrefix: 'TP_AGG' },
  { name: 'kl', names: KL_ESTIMATORS, cType: 'tp_loss_kl', cPrefix: 'TP_KL' },
  { name: 'tis', names: TIS_LEVELS, cType: 'tp_loss_tis', cPrefix: 'TP_TIS' },
];

type NumberField = Exclude<keyof LossConfig, EnumField['name']>;
export const LOSS_CONFIG_NUMBERS: readonly NumberField[] = [
  'clip_low',
  'clip_high',
  'dual_clip',
  'log_ratio_clamp',
  'norm_constant',
  'global_tokens',
  'global_sequences',
  'kl_coef',
  'tis_cap',
  'loss_scale',
];

/** tp_loss_metrics in field order; trainable_tokens is int64, the rest double. */
export const LOSS_METRICS_FIELDS: readonly (keyof LossMetrics)[] = [
  'loss',
  'pg_loss',
  'kl_loss',
  'clipfrac_high',
  'clipfrac_low',
  'clipfrac_dual',
  'approx_kl',
  'ratio_min',
  'ratio_mean',
  'ratio_max',
  'trainable_tokens',
];

export interface Status {
  name: string;
  message: string;
  /** The TreepackError code the N-API bindings throw for it. */
  error?: ErrorCode;
}

/** The status codes of both C ABIs (CPU and CUDA): the code of a status is its index. */
export const STATUSES: readonly Status[] = [
  { name: 'TP_OK', message: 'ok' },
  {
    name: 'TP_ERR_ARG',
    message: 'invalid argument: a required pointer is null, a count is negative or an option is out of range',
    error: 'E_ARG',
  },
  {
    name: 'TP_ERR_OFFSETS',
    message: 'invalid offsets: offsets[0] must be 0, offsets must be non-decreasing and offsets[S] must equal the number of tokens',
    error: 'E_ARG',
  },
  { name: 'TP_ERR_TOO_LARGE', message: 'too large: counts and positions must fit in int32', error: 'E_LIMIT' },
  { name: 'TP_ERR_ALLOC', message: 'out of memory', error: 'E_BACKEND' },
  { name: 'TP_ERR_TREE', message: 'not a packed forest: parent[p] must be in [-1, p) and subtree_end[p] in (p, N]', error: 'E_INPUT' },
  { name: 'TP_ERR_CAPACITY', message: 'output array too small', error: 'E_ARG' },
  { name: 'TP_ERR_SHARED', message: 'cu_seqlens needs a forest with no sharing, but a node has more than one child', error: 'E_INPUT' },
  { name: 'TP_ERR_INDEX', message: 'seq_positions holds a position outside [0, N)', error: 'E_INPUT' },
  { name: 'TP_ERR_DEVICE', message: 'CUDA runtime error (tp_cuda_last_error gives it)', error: 'E_BACKEND' },
  { name: 'TP_ERR_TURNS', message: 'turn_ids decreases inside a sequence (a turn is a run of equal ids)', error: 'E_INPUT' },
];

export interface ForestCheck {
  name: string;
  /** What is wrong, as a report's heading. */
  message: string;
  /** One example, from the fields of tp_violation: {index}, {value}, {expected}, {seq}, {t}. */
  example: string;
}

/**
 * The violation kinds of tp_forest_check (native/core/check.cc, docs/design.md §7 invariants 1, 2 and 4 and the padding
 * extension, and the turn_ids extension's order) in code order; the Python checker formats its report from them. The TypeScript checker is
 * src/pack/invariants.ts.
 */
export const FOREST_CHECKS: readonly ForestCheck[] = [
  { name: 'TP_CHECK_PARENT', message: 'parent not -1 or a position before the node', example: 'parent[{index}] = {value}' },
  { name: 'TP_CHECK_DEPTH', message: 'position_ids not the depth', example: 'position_ids[{index}] = {value}, expected {expected}' },
  { name: 'TP_CHECK_SUBTREE_RANGE', message: 'subtree_end out of (p, N]', example: 'subtree_end[{index}] = {value}' },
  {
    name: 'TP_CHECK_PREORDER',
    message: 'subtree not contiguous (layout not a DFS preorder)',
    example: 'the subtree of {index} spans [{index}, {value}) but has {expected} nodes',
  },
  {
    name: 'TP_CHECK_SUBTREE_END',
    message: 'subtree_end not the end of the subtree parent gives',
    example: 'subtree_end[{index}] = {value}, expected {expected}',
  },
  {
    name: 'TP_CHECK_PAD',
    message: 'pad node not a root with no children',
    example: 'parent[{index}] = {value}, subtree_end[{index}] = {expected}',
  },
  {
    name: 'TP_CHECK_OFFSETS',
    message: 'seq_offsets is not CSR offsets of M occurrences (0, non-decreasing, ending at M)',
    example: 'seq_offsets[{index}] = {value}',
  },
  { name: 'TP_CHECK_LOSS_MASK', message: 'loss_mask not 0 at t = 0', example: 'loss_mask[{index}] = {value} (sequence {seq}, t = {t})' },
  {
    name: 'TP_CHECK_POSITION_RANGE',
    message: 'seq_positions not in [0, N)',
    example: 'seq_positions[{index}] = {value} (sequence {seq}, t = {t})',
  },
  {
    name: 'TP_CHECK_POSITION_PAD',
    message: 'seq_positions at a pad node',
    example: 'seq_positions[{index}] = {value} (sequence {seq}, t = {t})',
  },
  {
    name: 'TP_CHECK_PATH',
    message: 'parent[seq_positions[k]] not seq_positions[k-1] (-1 at t = 0)',
    example: 'parent[seq_positions[{index}]] = {value}, expected {expected} (sequence {seq}, t = {t})',
  },
  {
    name: 'TP_CHECK_POSITION_T',
    message: 'position_ids[seq_positions[k]] not t',
    example: 'position_ids[seq_positions[{index}]] = {value}, expected {expected} (sequence {seq}, t = {t})',
  },
  {
    name: 'TP_CHECK_TURN_ORDER',
    message: 'turn_ids decreasing along a sequence',
    example: 'turn_ids[{index}] = {value} after {expected} (sequence {seq}, t = {t})',
  },
];

/** Constants of the loss formulas that every kernel (C++, CUDA, WGSL) restates. */
export const LOSS_CONSTANTS = { K3_LOG_CLAMP, K3_VALUE_CLAMP } as const;

/** The code of enum value `value` of config field `field`. */
export function enumCode(field: EnumField['name'], value: string): number {
  const e = LOSS_CONFIG_ENUMS.find((f) => f.name === field)!;
  const code = e.names.indexOf(value);
  if (code < 0) throw new Error(`no ${field} named ${value}`);
  return code;
}

/** A resolved config as tp_loss_config's fields in order (the N-API bindings read this Float64Array). */
export function configVector(cfg: LossConfig): Float64Array {
  const codes = configCodes(cfg);
  return Float64Array.from([...LOSS_CONFIG_ENUMS.map((e) => codes[e.name]), ...LOSS_CONFIG_NUMBERS.map((n) => cfg[n])]);
}

function fnv1a(text: string): string {
  let h = 0x811c9dc5;
  for (let i = 0; i < text.length; i++) {
    h ^= text.charCodeAt(i);
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  return h.toString(16).padStart(8, '0');
}

export const ABI_HASH = fnv1a(
  JSON.stringify([
    LOSS_CONFIG_ENUMS,
    LOSS_CONFIG_NUMBERS,
    LOSS_METRICS_FIELDS,
    STATUSES.map((s) => s.name),
    LOSS_CONSTANTS,
    FOREST_CHECKS.map((c) => c.name),
  ]),
);
