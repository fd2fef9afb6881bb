/**
 * One source of truth for the processor arithmetic: src/tokenize/images.ts's smart_resize, grids, placeholder counts
 * and 3-D rotary positions against transformers' own (Qwen2VLImageProcessorPil, which the Qwen2-VL, Qwen2.5-VL and
 * Qwen3-VL processors use, and Qwen2_5_VLModel / Qwen3VLModel.get_rope_index), run in Python on the same inputs
 * (test/helpers/vl_processor.py). The expected values come from transformers, never from this code. Skipped, with
 * the reason, without a Python with torch, transformers and pillow; TREEPACK_REQUIRE_TORCH=1 fails instead.
 */
import { spawnSync } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { pythonEnv } from '../scripts/python-env.mjs';
import type { ImageProcessor, ImageSpan } from '../src/records/images.js';
import { ImageRefusedError, imageGrid, ropeIndex } from '../src/tokenize/images.js';
import { rng } from './helpers/sequences.js';

const env = pythonEnv();
function why(): string {
  if (!env.python || !env.torch) return env.reason || 'no Python with torch and transformers';
  const r = spawnSync(env.python, ['-c', 'import PIL'], { encoding: 'utf8' });
  return r.status === 0 ? '' : 'pillow is missing from the Python environment (python/requirements-torch.txt lists it)';
}
const skipReason = why();
if (skipReason && process.env.TREEPACK_REQUIRE_TORCH === '1')
  throw new Error(`test/images-python.test.ts: TREEPACK_REQUIRE_TORCH=1 but ${skipReason}`);
if (skipReason) console.log(`test/images-python.test.ts skipped: ${skipReason}`);

const SCRIPT = fileURLToPath(new URL('./helpers/vl_processor.py', import.meta.url));

const settings = (family: ImageProcessor['family'], patch: number, min: number, max: number): ImageProcessor => ({
  family,
  patch_size: patch,
  merge_size: 2,
  temporal_patch_size: 2,
  min_pixels: min,
  max_pixels: max,
  image_token_id: 151655,
  vision_start_token_id: 151652,
  vision_end_token_id: 151653,
});
const SETTINGS = [
  settings('qwen2_5_vl', 14, 56 * 56, 28 * 28 * 1280), // transformers' defaults
  settings('qwen2_5_vl', 14, 3136, 12845056), // Qwen2.5-VL's preprocessor_config.json
  settings('qwen3_vl', 16, 65536, 16777216), // Qwen3-VL's
  settings('qwen2_5_vl', 14, 28 * 28 * 4, 28 * 28 * 64), // small screenshots, as the tests pack them
];

/** Sizes: edges (1 pixel, aspect 200 and just past it, exact multiples, halves that round to even) and random ones. */
function sizes(): [number, number][] {
  const out: [number, number][] = [
    [1, 1],
    [1, 200],
    [1, 201],
    [200, 1],
    [28, 28],
    [42, 42],
    [70, 98],
    [14, 42],
    [56, 84],
    [1080, 1920],
    [2160, 3840],
    [8192, 8192],
    [3, 599],
    [127, 4],
  ];
  const rand = rng(35);
  for (let k = 0; k < 60; k++) out.push([1 + Math.floor(rand() * 2500), 1 + Math.floor(rand() * 2500)]);
  return out;
}

interface ProcessorAnswer {
  patches?: number;
  grid?: number[];
  error?: string;
}

describe.skipIf(skipReason !== '')('the processor arithmetic equals transformers', () => {
  it('smart_resize grids, placeholder counts, refusals and rotary positions', { timeout: 300_000 }, () => {
    const all = sizes();
    // Rotary cases: text runs and images of random sizes, vision markers around each, for both families.
    const rand = rng(7);
    const rope = SETTINGS.slice(2).flatMap((p) =>
      [0, 1, 2].map(() => {
        const tokens: number[] = [];
        const spans: ImageSpan[] = [];
        for (let k = 0; k < 1 + Math.floor(rand() * 3); k++) {
          for (let t = Math.floor(rand() * 5); t > 0; t--) tokens.push(1 + Math.floor(rand() * 1000));
          tokens.push(p.vision_start_token_id);
          const [h, w] = [28 + Math.floor(rand() * 400), 28 + Math.floor(rand() * 400)];
          const grid = imageGrid(h, w, p);
          const n = (grid[0] * grid[1] * grid[2]) / 4;
          spans.push({ start: tokens.length, image: { grid, tokens: n } as never });
          for (let j = 0; j < n; j++) tokens.push(p.image_token_id);
          tokens.push(p.vision_end_token_id);
        }
        tokens.push(1, 2, 3);
        return { p, tokens, spans };
      }),
    );
    const input = {
      processor: SETTINGS.map((s) => ({ settings: s, sizes: all })),
      rope: rope.map(({ p, tokens, spans }) => ({
        family: p.family,
        merge_size: p.merge_size,
        image_token_id: p.image_token_id,
        tokens,
        grids: spans.map((s) => s.image.grid),
      })),
    };
    const r = spawnSync(env.python!, [SCRIPT], { input: JSON.stringify(input), encoding: 'utf8', maxBuffer: 64 << 20, timeout: 280_000 });
    expect(r.status, r.stderr).toBe(0);
    const got = JSON.parse(r.stdout) as { processor: ProcessorAnswer[][]; rope: number[][][] };
    let compared = 0,
      refused = 0;
    SETTINGS.forEach((p, si) => {
      all.forEach(([h, w], k) => {
        const want = got.processor[si][k];
        let grid: [number, number, number] | undefined;
        let error = '';
        try {
          grid = imageGrid(h, w, p);
        } catch (e) {
          if (!(e instanceof ImageRefusedError)) throw e;
          error = e.message;
        }
        const at = `${p.family}/${p.patch_size}/${p.max_pixels} ${h}×${w}`;
        if (want.error !== undefined) {
          expect(error, at).toMatch(/aspect ratio must be smaller than 200/);
          refused++;
          return;
        }
        expect(grid, at).toBeDefined();
        expect(grid![0] * grid![1] * grid![2], at).toBe(want.patches);
        if (want.grid) expect(grid, at).toEqual(want.grid);
        compared++;
      });
    });
    expect(refused).toBeGreaterThanOrEqual(SETTINGS.length); // 1×201 under every setting, and any random size past 200:1
    expect(compared).toBeGreaterThan(250);
    rope.forEach(({ p, tokens, spans }, k) => {
      const mine = ropeIndex(tokens.length, spans, p.merge_size);
      const L = tokens.length;
      const rows = [0, 1, 2].map((d) => Array.from(mine.subarray(d * L, (d + 1) * L)));
      expect(rows, `rope case ${k} (${p.family})`).toEqual(got.rope[k]);
    });
  });
});
