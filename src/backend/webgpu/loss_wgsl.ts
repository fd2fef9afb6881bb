// WGSL source of the loss kernels, kept in a .ts module so that it ships inside dist/ with no loader.
export const LOSS_WGSL = /* wgsl */ `
// The RL loss on WebGPU (f32; semantics of src/loss/policy.ts and kl.ts). The host hands over only the trainable
// occurrences, in sequence order, each with its precomputed weights (aggregation × truncated IS weight, and the
// aggregation weight for KL), so the kernels never see a masked position. Three entry points:
//   gspo_seq     workgroup per sequence: GSPO's mean log ratio
//   occurrences  thread per trainable occurrence: gradient contribution, and one metric partial per workgroup
//   nodes        thread per node: the gradient, summing its occurrences in a fixed order (no atomics)

struct Params {
  clip_low: f32,
  clip_high: f32,
  dual_clip: f32,
  log_clamp: f32,
  kl_coef: f32,
  policy: u32, // 0 ppo, 1 gspo, 2 cispo
  kl: u32, // 0 none, 1 k1, 2 abs, 3 k2, 4 k3
  count: u32, // trainable occurrences
  num_seqs: u32,
  num_nodes: u32,
  pad0: u32,
  pad1: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
// Two vec4 per occurrence: (pg_weight, kl_weight, advantage, old), (ref, bitcast pos, bitcast seq, 0).
@group(0) @binding(1) var<storage, read> occ: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> lp: array<f32>;
@group(0) @binding(3) var<storage, read_write> seq_lr: array<f32>;
@group(0) @binding(4) var<storage, read> seq_range: array<u32>;
@group(0) @binding(5) var<storage, read_write> contrib: array<f32>;
@group(0) @binding(6) var<storage, read_write> partials: array<f32>;
@group(0) @binding(7) var<storage, read> node_off: array<u32>;
@group(0) @binding(8) var<storage, read> node_occ: array<u32>;
@group(0) @binding(9) var<storage, read_write> grad: array<f32>;

const WG: u32 = 128u; // the compatibility-mode limit on invocations per workgroup
const NSUMS: u32 = 10u; // pg, kl, n, high, low, dual, log_ratio, ratio, min, max
var<workgroup> sh: array<array<f32, 128>, 10>;

fn flat_id(wid: vec3<u32>, lid: vec3<u32>, nwg: vec3<u32>) -> u32 {
  return (wid.y * nwg.x + wid.x) * WG + lid.x;
}

var<workgroup> seq_sh: array<f32, 128>;

// One workgroup per sequence, a fixed-shape tree over its threads' strided sums.
@compute @workgroup_size(128)
fn gspo_seq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let i = wid.y * nwg.x + wid.x;
  var a = 0u;
  var e = 0u;
  if (i < P.num_seqs) {
    a = seq_range[i];
    e = seq_range[i + 1u];
  }
  var s = 0.0;
  for (var k = a + lid.x; k < e; k += WG) {
    let pos = bitcast<u32>(occ[2u * k + 1u].y);
    s += lp[pos] - occ[2u * k].w;
  }
  seq_sh[lid.x] = s;
  workgroupBarrier();
  for (var w = WG / 2u; w > 0u; w /= 2u) {
    if (lid.x < w) { seq_sh[lid.x] += seq_sh[lid.x + w]; }
    workgroupBarrier();
  }
  if (lid.x == 0u && i < P.num_seqs) {
    seq_lr[i] = select(0.0, seq_sh[0] / f32(e - a), e > a);
  }
}

@compute @workgroup_size(128)
fn occurrences(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let k = flat_id(wid, lid, nwg);
  var v: array<f32, 10>;
  v[8] = 3.0e38;
  v[9] = -3.0e38;
  if (k < P.count) {
    let a = occ[2u * k];
    let b = occ[2u * k + 1u];
    let x = lp[bitcast<u32>(b.y)];
    let A = a.z;
    let old = a.w;
    let C = P.log_clamp;
    let hi = 1.0 + P.clip_high;
    let lo = 1.0 - P.clip_low;
    var value = 0.0;
    var d = 0.0;
    var r = 0.0;
    if (P.policy == 2u) {
      r = exp(clamp(x - old, -C, C));
      let w = clamp(r, lo, hi);
      value = -w * A * x;
      d = -w * A;
      v[3] = select(0.0, 1.0, r > hi);
      v[4] = select(0.0, 1.0, r < lo);
    } else {
      var lr = x - old;
      if (P.policy == 1u) { lr = seq_lr[bitcast<u32>(b.z)]; }
      r = exp(clamp(lr, -C, C));
      let dr = select(0.0, r, lr >= -C && lr <= C);
      let l1 = -A * r;
      let l2 = -A * clamp(r, lo, hi);
      value = l1;
      d = -A * dr;
      if (l2 > l1) {
        value = l2;
        d = 0.0;
        v[3] = select(0.0, 1.0, A > 0.0);
        v[4] = select(0.0, 1.0, A <= 0.0);
      }
      if (A < 0.0 && P.dual_clip > 0.0 && value > -A * P.dual_clip) {
        value = -A * P.dual_clip;
        d = 0.0;
        v[5] = 1.0;
      }
    }
    v[0] = a.x * value;
    var g = a.x * d;
    if (P.kl != 0u) {
      let diff = x - b.x;
      var kv = 0.0;
      var kd = 0.0;
      if (P.kl == 1u) { kv = diff; kd = 1.0; }
      else if (P.kl == 2u) { kv = abs(diff); kd = sign(diff); }
      else if (P.kl == 3u) { kv = 0.5 * diff * diff; kd = diff; }
      else {
        let xs = -diff;
        let xc = clamp(xs, -20.0, 20.0);
        let e = exp(xc);
        let raw = e - xc - 1.0;
        kv = clamp(raw, -10.0, 10.0);
        kd = select(0.0, 1.0 - e, xs >= -20.0 && xs <= 20.0 && raw <= 10.0 && raw >= -10.0);
      }
      v[1] = a.y * kv;
      g += P.kl_coef * a.y * kd;
    }
    contrib[k] = g;
    v[2] = 1.0;
    v[6] = old - x;
    v[7] = r;
    v[8] = r;
    v[9] = r;
  }
  for (var f = 0u; f < NSUMS; f++) { sh[f][lid.x] = v[f]; }
  workgroupBarrier();
  for (var w = WG / 2u; w > 0u; w /= 2u) {
    if (lid.x < w) {
      for (var f = 0u; f < 8u; f++) { sh[f][lid.x] += sh[f][lid.x + w]; }
      sh[8][lid.x] = min(sh[8][lid.x], sh[8][lid.x + w]);
      sh[9][lid.x] = max(sh[9][lid.x], sh[9][lid.x + w]);
    }
    workgroupBarrier();
  }
  if (lid.x == 0u) {
    let base = (wid.y * nwg.x + wid.x) * NSUMS;
    for (var f = 0u; f < NSUMS; f++) { partials[base + f] = sh[f][0]; }
  }
}

@compute @workgroup_size(128)
fn nodes(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let p = flat_id(wid, lid, nwg);
  if (p >= P.num_nodes) { return; }
  var g = 0.0;
  for (var k = node_off[p]; k < node_off[p + 1u]; k++) { g += contrib[node_occ[k]]; }
  grad[p] = g;
}
`;
