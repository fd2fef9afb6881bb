/**
 * WGSL kernels of the mask lowerings (host code: mask.ts; reference: src/mask). Written for WebGPU compatibility
 * mode (the Mesa GL software adapter): no f16, no subgroups, at most 4 storage buffers per stage. Invocations are
 * numbered linearly over a 2-D grid, since one dimension holds at most 65535 workgroups.
 */

export const WORKGROUP_SIZE = 64;

/** A compute shader: Params at binding 0, `bindings` after it, and `body` run with invocation number `index`. */
function shader(bindings: string, index: string, body: string): string {
  return /* wgsl */ `
struct Params { n: u32, block: u32, nb: u32, width: u32 }
@group(0) @binding(0) var<uniform> P: Params;
${bindings}
@compute @workgroup_size(${WORKGROUP_SIZE})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let ${index} = gid.y * nwg.x * ${WORKGROUP_SIZE}u + gid.x;
${body}
}
`;
}

/** subtree_end in, u32 words out, and the attention rule: q attends to k iff k <= q < subtree_end[k]. */
const TREE_TO_WORDS = /* wgsl */ `
@group(0) @binding(1) var<storage, read> se: array<i32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;
fn visible(q: u32, k: u32) -> bool {
  return k <= q && q < u32(se[k]);
}`;

/** Dense bool [n, n] as bytes, four per u32 word (little-endian: byte b of word w is pair 4w + b). */
export const DENSE_WGSL = shader(
  TREE_TO_WORDS,
  'w',
  `  if (w >= P.width) { return; }
  var word = 0u;
  for (var b = 0u; b < 4u; b++) {
    let i = 4u * w + b;
    if (i < P.n * P.n && visible(i / P.n, i % P.n)) { word |= 1u << (8u * b); }
  }
  out[w] = word;`,
);

/** Packed bits [n, width = ceil(n / 32)]: bit k % 32 of word (q, k / 32). */
export const BITS_WGSL = shader(
  TREE_TO_WORDS,
  'w',
  `  if (w >= P.n * P.width) { return; }
  let q = w / P.width;
  let k0 = (w % P.width) * 32u;
  var word = 0u;
  for (var b = 0u; b < 32u; b++) {
    let k = k0 + b;
    if (k < P.n && visible(q, k)) { word |= 1u << b; }
  }
  out[w] = word;`,
);

/** Per kv block j: ends[2j] = floor(lo_j / B) (full up to there), ends[2j+1] = min(nb, ceil(hi_j / B)). */
export const BLOCK_ENDS_WGSL = shader(
  `@group(0) @binding(1) var<storage, read> se: array<i32>;
@group(0) @binding(2) var<storage, read_write> ends: array<u32>;`,
  'j',
  `  if (j >= P.nb) { return; }
  var lo = P.n;
  var hi = 0u;
  let end = min(P.n, (j + 1u) * P.block);
  for (var k = j * P.block; k < end; k++) {
    let e = u32(se[k]);
    lo = min(lo, e);
    hi = max(hi, e);
  }
  ends[2u * j] = lo / P.block;
  ends[2u * j + 1u] = min(P.nb, (hi + P.block - 1u) / P.block);`,
);

/**
 * Row i of the block mask, written front to back by one invocation: nums[i] partial and nums[nb + i] full
 * counts. The index rows past the counts stay 0 (WebGPU zero-initialises buffers).
 */
export const BLOCK_ROWS_WGSL = shader(
  `@group(0) @binding(1) var<storage, read> ends: array<u32>;
@group(0) @binding(2) var<storage, read_write> nums: array<i32>;
@group(0) @binding(3) var<storage, read_write> kv_idx: array<i32>;
@group(0) @binding(4) var<storage, read_write> full_idx: array<i32>;`,
  'i',
  `  if (i >= P.nb) { return; }
  let row = i * P.nb;
  var np = 0u;
  var nf = 0u;
  for (var j = 0u; j < i; j++) {
    if (i < ends[2u * j]) {
      full_idx[row + nf] = i32(j);
      nf++;
    } else if (i < ends[2u * j + 1u]) {
      kv_idx[row + np] = i32(j);
      np++;
    }
  }
  if (P.block == 1u) {
    full_idx[row + nf] = i32(i);
    nf++;
  } else {
    kv_idx[row + np] = i32(i);
    np++;
  }
  nums[i] = i32(np);
  nums[P.nb + i] = i32(nf);`,
);
