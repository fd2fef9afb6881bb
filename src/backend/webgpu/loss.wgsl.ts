// WGSL source of the loss kernels, kept in a .ts module so that it ships inside dist/ with no loader. Enum codes and
// constants are injected from the ABI tables (src/backend/abi.ts), the sizes from here (loss.ts reads them too).
import { enumCode, LOSS_CONSTANTS } from '../abi.js';

/** Invocations per workgroup: the compatibility-mode limit. */
export const WG = 128;
/** Metric partials per workgroup: pg, kl, n, high, low, dual, log ratio, ratio, min, max. */
export const NSUMS = 10;

const policy = (name: string) => `${enumCode('policy', name)}u`;
const kl = (name: string) => `${enumCode('kl', name)}u`;
const real = (x: number) => (Number.isInteger(x) ? x.toFixed(1) : String(x));

export const LOSS_WGSL = /* wgsl */ `
// The RL loss on WebGPU (f32; semantics of src/loss/policy.ts, kl.ts and reference.ts). Layout in loss-layout.ts:
// the host hands over only trainable occurrences, sorted by node, with their weights precomputed, in chunks that
// each fit one binding. Three entry points, none with atomics, every sum in a fixed order:
//   gspo_seq   workgroup per sequence of a sequence-stream chunk: GSPO's mean log ratio (running sum across chunks)
//   occ_nodes  thread per run of whole nodes of an occurrence chunk: their gradients, and metric partials
//   compact    compact per-node plan: thread per COMPACT nodes strided by the workgroup size
// Metrics: one partial per workgroup (pg, kl, n, high, low, dual, log ratio, ratio, min, max; counts as u32),
// summed on the host in float64 in workgroup order.

struct Params {
  clip_low: f32,
  clip_high: f32,
  dual_clip: f32,
  log_clamp: f32,
  kl_coef: f32,
  policy: u32, // code of POLICY_LOSSES
  kl: u32, // code of KL_ESTIMATORS
  count: u32, // occ_nodes: threads; gspo_seq: local sequences; compact: local nodes
  base: u32, // occ_nodes: offset of the thread table in idx; gspo_seq: rank of the first local sequence
  first_total: u32, // gspo_seq: trainable tokens of the first sequence when it began in an earlier chunk, else 0
  last_open: u32, // gspo_seq: 1 when the last sequence continues in the next chunk
  per_thread: u32, // compact: nodes per thread
}

@group(0) @binding(0) var<uniform> P: Params;
// occ_nodes: per occurrence (pg weight, advantage, old, kl weight) and (ref, bitcast sequence rank).
@group(0) @binding(1) var<storage, read> occ_a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> occ_b: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read> lp: array<f32>;
// occ_nodes: local node offsets, then the thread table (first local node per thread) from P.base.
@group(0) @binding(4) var<storage, read> idx: array<u32>;
@group(0) @binding(5) var<storage, read_write> grad: array<f32>;
@group(0) @binding(6) var<storage, read_write> partials: array<u32>;
// GSPO: mean log ratio per sequence rank (written by gspo_seq, read by occ_nodes).
@group(0) @binding(7) var<storage, read_write> seq_lr: array<f32>;
// gspo_seq: (bitcast node, old) per occurrence in sequence order, and local sequence offsets.
@group(0) @binding(8) var<storage, read> seq_occ: array<vec2<f32>>;
@group(0) @binding(9) var<storage, read> seq_range: array<u32>;
// compact: per node (old, ref, pos weight, neg weight) and (bitcast kl weight, n_train, n_pos, n_neg).
@group(0) @binding(10) var<storage, read> plan_a: array<vec4<f32>>;
@group(0) @binding(11) var<storage, read> plan_b: array<vec4<u32>>;

const WG: u32 = ${WG}u;
const NSUMS: u32 = ${NSUMS}u;

struct Acc {
  pg: f32,
  kl: f32,
  n: u32,
  high: u32,
  low: u32,
  dual: u32,
  log_ratio: f32, // Σ old − lp
  ratio: f32,
  rmin: f32,
  rmax: f32,
}

fn acc_new() -> Acc {
  return Acc(0.0, 0.0, 0u, 0u, 0u, 0u, 0.0, 0.0, 3.0e38, -3.0e38);
}

// count occurrences with ratio r and log ratio lr = lp − old
fn acc_ratio(a: ptr<function, Acc>, count: u32, r: f32, lr: f32) {
  (*a).n += count;
  (*a).ratio += f32(count) * r;
  (*a).log_ratio -= f32(count) * lr;
  (*a).rmin = min((*a).rmin, r);
  (*a).rmax = max((*a).rmax, r);
}

var<workgroup> shf: array<array<f32, ${WG}>, 6>; // pg, kl, log_ratio, ratio, min, max
var<workgroup> shu: array<array<u32, ${WG}>, 4>; // n, high, low, dual

fn flat_group(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
  return wid.y * nwg.x + wid.x;
}

// Fixed-shape tree over the workgroup; thread 0 writes the group's partial. Called in uniform control flow.
fn reduce_store(a: Acc, l: u32, group: u32) {
  shf[0][l] = a.pg;
  shf[1][l] = a.kl;
  shf[2][l] = a.log_ratio;
  shf[3][l] = a.ratio;
  shf[4][l] = a.rmin;
  shf[5][l] = a.rmax;
  shu[0][l] = a.n;
  shu[1][l] = a.high;
  shu[2][l] = a.low;
  shu[3][l] = a.dual;
  workgroupBarrier();
  for (var w = WG / 2u; w > 0u; w /= 2u) {
    if (l < w) {
      for (var f = 0u; f < 4u; f++) {
        shf[f][l] += shf[f][l + w];
        shu[f][l] += shu[f][l + w];
      }
      shf[4][l] = min(shf[4][l], shf[4][l + w]);
      shf[5][l] = max(shf[5][l], shf[5][l + w]);
    }
    workgroupBarrier();
  }
  if (l == 0u) {
    let o = group * NSUMS;
    partials[o] = bitcast<u32>(shf[0][0]);
    partials[o + 1u] = bitcast<u32>(shf[1][0]);
    partials[o + 2u] = shu[0][0];
    partials[o + 3u] = shu[1][0];
    partials[o + 4u] = shu[2][0];
    partials[o + 5u] = shu[3][0];
    partials[o + 6u] = bitcast<u32>(shf[2][0]);
    partials[o + 7u] = bitcast<u32>(shf[3][0]);
    partials[o + 8u] = bitcast<u32>(shf[4][0]);
    partials[o + 9u] = bitcast<u32>(shf[5][0]);
  }
}

// [kl, dkl/dlp] of src/loss/kl.ts
fn kl_term(x: f32, ref_lp: f32) -> vec2<f32> {
  let diff = x - ref_lp;
  if (P.kl == ${kl('k1')}) { return vec2<f32>(diff, 1.0); }
  if (P.kl == ${kl('abs')}) { return vec2<f32>(abs(diff), sign(diff)); }
  if (P.kl == ${kl('k2')}) { return vec2<f32>(0.5 * diff * diff, diff); }
  // ${kl('k3')}
  let L = ${real(LOSS_CONSTANTS.K3_LOG_CLAMP)};
  let V = ${real(LOSS_CONSTANTS.K3_VALUE_CLAMP)};
  let xs = -diff;
  let xc = clamp(xs, -L, L);
  let e = exp(xc);
  let raw = e - xc - 1.0;
  return vec2<f32>(clamp(raw, -V, V), select(0.0, 1.0 - e, xs >= -L && xs <= L && raw <= V && raw >= -V));
}

var<workgroup> seq_sh: array<f32, ${WG}>;

// One workgroup per local sequence, a fixed-shape tree over its threads' strided sums of lp − old.
@compute @workgroup_size(${WG})
fn gspo_seq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let q = flat_group(wid, nwg);
  var a = 0u;
  var e = 0u;
  if (q < P.count) {
    a = seq_range[q];
    e = seq_range[q + 1u];
  }
  var s = 0.0;
  for (var k = a + lid.x; k < e; k += WG) {
    let o = seq_occ[k];
    s += lp[bitcast<u32>(o.x)] - o.y;
  }
  seq_sh[lid.x] = s;
  workgroupBarrier();
  for (var w = WG / 2u; w > 0u; w /= 2u) {
    if (lid.x < w) { seq_sh[lid.x] += seq_sh[lid.x + w]; }
    workgroupBarrier();
  }
  if (lid.x == 0u && q < P.count) {
    var sum = seq_sh[0];
    var n = e - a;
    let g = P.base + q;
    if (q == 0u && P.first_total > 0u) {
      sum += seq_lr[g]; // the running sum left by the previous chunk's dispatch
      n = P.first_total;
    }
    if (q + 1u == P.count && P.last_open != 0u) {
      seq_lr[g] = sum;
    } else {
      seq_lr[g] = sum / f32(n);
    }
  }
}

@compute @workgroup_size(${WG})
fn occ_nodes(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let group = flat_group(wid, nwg);
  let t = group * WG + lid.x;
  var acc = acc_new();
  if (t < P.count) {
    let C = P.log_clamp;
    let hi = 1.0 + P.clip_high;
    let lo = 1.0 - P.clip_low;
    // One loop over the thread's occurrences (the same trip count on every lane), stepping to the next node at
    // each boundary; nodes without occurrences get a zero gradient.
    let q1 = idx[P.base + t + 1u];
    var q = idx[P.base + t];
    let k1 = idx[q1];
    var next = idx[q + 1u];
    var x = lp[q];
    var g = 0.0;
    for (var k = idx[q]; k < k1; k++) {
      while (k == next) {
        grad[q] = g;
        g = 0.0;
        q++;
        next = idx[q + 1u];
        x = lp[q];
      }
      let o = occ_a[k];
      let A = o.y;
      let old = o.z;
      var value = 0.0;
      var d = 0.0;
      var r = 0.0;
      if (P.policy == ${policy('cispo')}) {
        r = exp(clamp(x - old, -C, C));
        let w = clamp(r, lo, hi);
        value = -w * A * x;
        d = -w * A;
        acc.high += select(0u, 1u, r > hi);
        acc.low += select(0u, 1u, r < lo);
      } else {
        var lr = x - old;
        if (P.policy == ${policy('gspo')}) { lr = seq_lr[bitcast<u32>(occ_b[k].y)]; }
        r = exp(clamp(lr, -C, C));
        let l1 = -A * r;
        let l2 = -A * clamp(r, lo, hi);
        value = l1;
        d = -A * select(0.0, r, lr >= -C && lr <= C);
        if (l2 > l1) {
          value = l2;
          d = 0.0;
          acc.high += select(0u, 1u, A > 0.0);
          acc.low += select(0u, 1u, A <= 0.0);
        }
        if (A < 0.0 && P.dual_clip > 0.0 && value > -A * P.dual_clip) {
          value = -A * P.dual_clip;
          d = 0.0;
          acc.dual += 1u;
        }
      }
      acc.pg += o.x * value;
      g += o.x * d;
      if (P.kl != 0u) {
        let kt = kl_term(x, occ_b[k].x);
        acc.kl += o.w * kt.x;
        g += P.kl_coef * o.w * kt.y;
      }
      acc_ratio(&acc, 1u, r, x - old);
    }
    loop {
      grad[q] = g;
      g = 0.0;
      q++;
      if (q >= q1) { break; }
    }
  }
  reduce_store(acc, lid.x, group);
}

@compute @workgroup_size(${WG})
fn compact(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let group = flat_group(wid, nwg);
  var acc = acc_new();
  let C = P.log_clamp;
  let hi = 1.0 + P.clip_high;
  let lo = 1.0 - P.clip_low;
  for (var j = 0u; j < P.per_thread; j++) {
    let q = (group * P.per_thread + j) * WG + lid.x;
    if (q >= P.count) { continue; }
    let u = plan_b[q];
    if (u.y == 0u) {
      grad[q] = 0.0;
      continue;
    }
    let f = plan_a[q];
    let x = lp[q];
    let lr = x - f.x;
    let r = exp(clamp(lr, -C, C));
    let dr = select(0.0, r, lr >= -C && lr <= C);
    let pw = f.z;
    let nw = f.w;
    var value = 0.0;
    var g = 0.0;
    if (P.policy == ${policy('cispo')}) {
      let w = clamp(r, lo, hi);
      value = -w * x * (pw - nw);
      g = -w * (pw - nw);
      acc.high += select(0u, u.y, r > hi);
      acc.low += select(0u, u.y, r < lo);
    } else {
      // A > 0: −A·min(r, 1+εh); A < 0: |A|·max(r, 1−εl), capped at |A|·c by the dual clip.
      let high_clipped = r > hi;
      let low_clipped = r < lo;
      let up = select(r, lo, low_clipped);
      let dual_clipped = P.dual_clip > 0.0 && up > P.dual_clip;
      value = -pw * select(r, hi, high_clipped) + nw * select(up, P.dual_clip, dual_clipped);
      g = -pw * select(dr, 0.0, high_clipped) + nw * select(dr, 0.0, dual_clipped || low_clipped);
      acc.high += select(0u, u.z, high_clipped);
      acc.low += select(0u, u.w, low_clipped);
      acc.dual += select(0u, u.w, dual_clipped);
    }
    acc.pg += value;
    if (P.kl != 0u) {
      let klw = bitcast<f32>(u.x);
      let kt = kl_term(x, f.y);
      acc.kl += klw * kt.x;
      g += P.kl_coef * klw * kt.y;
    }
    acc_ratio(&acc, u.y, r, lr);
    grad[q] = g;
  }
  reduce_store(acc, lid.x, group);
}
`;
