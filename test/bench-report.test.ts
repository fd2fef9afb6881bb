/**
 * The bench's HTML report opened in headless Chromium: every figure rendered marks from its data, nothing failed
 * to load, the console stayed clean; a screenshot is saved. The page is rendered from report data built here by
 * the cost model and the step analysis over figures of a known shape (not from a bench run, which takes minutes).
 * Skips when Chromium is absent, unless TREEPACK_REQUIRE_CHROMIUM=1 (CI).
 */
import { existsSync, mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { renderHtml, type ReportData } from '../bench/report.js';
import { analyzeStep } from '../bench/step-report.js';
import { CPU_SHAPE, type StepSection, type StepWorkload } from '../bench/step.js';
import { devicePeak, type ModelShape, type SideFigures } from '../bench/cost-model.js';

const CHROMIUM = process.env.TREEPACK_CHROMIUM ?? '/usr/bin/chromium';
const required = process.env.TREEPACK_REQUIRE_CHROMIUM === '1';
const have = existsSync(CHROMIUM);
if (!have) console.warn(`bench report test: skipped, no Chromium at ${CHROMIUM} (apt-get install chromium, or set TREEPACK_CHROMIUM)`);

/** A workload whose packed side holds 1/c of the naive tokens; step times follow a fixed rate per token. */
function workload(name: string, c: number): StepWorkload {
  const side = (tokens: number, mbs: number): SideFigures => ({
    micro_batches: mbs,
    tokens,
    occurrences: tokens,
    trainable: 500,
    pairs: tokens * 900,
    blocks: Math.ceil((tokens * 900) / 128 / 128) + tokens / 128,
    full_blocks: 0,
    scored_rows: 500,
    max_tokens: 16384,
  });
  const f = { naive: side(8000 * c, Math.ceil(c / 2)), merged: side(16000, 1), packed: side(8000, 1) };
  const time = (s: SideFigures) => ({
    step: s.tokens * 1e-4 + s.micro_batches * 0.05,
    masks: 0.01,
    forward: s.tokens * 3e-5,
    loss: 0.001,
    backward: s.tokens * 6e-5,
    steps: [1],
    peak_bytes: s.tokens * 4096,
    logprob_sum: -1,
    grad_norm: 1,
  });
  return {
    name,
    compression: c,
    packSeconds: 0.2,
    report: { timelines: 8 * c, samples: 8 } as StepWorkload['report'],
    figures: f,
    sides: {
      naive: { ...time(f.naive), loss_value: 0.5 },
      merged: { ...time(f.merged), loss_value: 0.5 },
      packed: { ...time(f.packed), loss_value: 0.5 },
    },
    mismatches: {},
  };
}

describe.skipIf(!have && !required)('bench report in Chromium', () => {
  it('renders every figure with data and no console errors', { timeout: 120_000 }, async () => {
    expect(have, `Chromium required (TREEPACK_REQUIRE_CHROMIUM=1) but ${CHROMIUM} is missing`).toBe(true);
    const section: StepSection = {
      device: 'CPU, 2 threads',
      deviceType: 'cpu',
      dtype: 'float32',
      attention: 'block',
      torch: 'test',
      shape: CPU_SHAPE,
      maxTokens: 16384,
      workloads: [workload('a', 4), workload('b', 9), workload('c', 20)],
    };
    const step = analyzeStep(section);
    expect(step.rows).toHaveLength(3);
    expect(step.modelError!.max).toBeLessThan(0.05); // times are linear in the model's own features: near exact
    const data: ReportData = {
      title: 'treepack bench (test)',
      generated: 'test',
      environment: ['test'],
      step: { device: 'CPU (test)', rows: step.rows },
      sparsity: [1024, 4096, 16384].map((N) => ({
        N,
        blockSize: 128,
        causalBlocks: 100,
        listedBlocks: 40,
        fullBlocks: 10,
        skippedFraction: 0.6,
        visibleFraction: 0.3,
      })),
      loss: [1e4, 1e5].flatMap((M) =>
        ['js', 'cpu'].map((backend) => ({
          M,
          N: M / 4,
          backend,
          mode: 'compact' as const,
          seconds: 0.01,
          occurrencesPerSecond: M * 100,
          gbPerSecond: 1,
        })),
      ),
      merge: [10, 100].map((t) => ({
        dataset: 'generated',
        scope: 'one pool' as const,
        timelines: t,
        treepack: { samples: 1, packedTokens: 1, naiveTokens: 1, seconds: t * 1e-4, wrongMerges: 0 },
        agentjet: { samples: 1, packedTokens: 1, naiveTokens: 1, seconds: t * t * 1e-5, wrongMerges: 0 },
      })),
    };
    const dir = mkdtempSync(join(tmpdir(), 'treepack-report-'));
    const page = join(dir, 'report.html');
    writeFileSync(page, await renderHtml(data, [step.text]));

    const { chromium } = await import('playwright-core');
    const browser = await chromium.launch({
      executablePath: CHROMIUM,
      args: [
        '--headless',
        '--no-sandbox',
        '--disable-gpu',
        '--disable-background-networking',
        '--disable-component-update',
        '--no-first-run',
      ],
    });
    try {
      const tab = await browser.newPage({ viewport: { width: 1280, height: 900 } });
      const problems: string[] = [];
      tab.on('console', (m) => m.type() === 'error' && problems.push(m.text()));
      tab.on('pageerror', (e) => problems.push(e.message));
      tab.on('requestfailed', (r) => problems.push(`failed to load ${r.url()}`));
      await tab.goto(`file://${page}`);
      const figures = await tab.$$eval('figure[data-figure]', (fs) =>
        fs.map((f) => ({
          id: f.getAttribute('data-figure'),
          rows: Number(f.getAttribute('data-rows')),
          // Marks that carry data: points, lines and bars vega drew into the SVG, with a real size on screen.
          marks: [...f.querySelectorAll('svg g.mark-symbol path, svg g.mark-line path, svg g.mark-rect path')].filter((m) => {
            const b = (m as SVGGraphicsElement).getBBox();
            return b.width > 0 || b.height > 0;
          }).length,
          width: f.querySelector('svg')?.getBoundingClientRect().width ?? 0,
        })),
      );
      expect(figures.map((f) => f.id)).toEqual(['step-speedup', 'step-breakdown', 'sparsity', 'loss-throughput', 'merge-time']);
      for (const f of figures) {
        expect(f.rows, f.id!).toBeGreaterThan(0);
        expect(f.width, f.id!).toBeGreaterThan(200);
        expect(f.marks, f.id!).toBeGreaterThanOrEqual(Math.min(f.rows, 3));
      }
      expect(problems).toEqual([]);
      const shot = join(dir, 'report.png');
      await tab.screenshot({ path: shot, fullPage: true });
      expect(existsSync(shot)).toBe(true);
      console.log(`bench report screenshot: ${shot}`);
    } finally {
      await browser.close();
    }
  });
});

describe('training-step analysis', () => {
  it("reports a merged side that is naive's (the merge joined no call) as naive, outside the fit and its error", () => {
    const same = (w: StepWorkload): StepWorkload => {
      const sides = w.sides!;
      return {
        ...w,
        figures: { ...w.figures!, merged: w.figures!.naive },
        sides: { ...sides, merged: { ...sides.naive, same_as_naive: true } },
      };
    };
    const section: StepSection = {
      device: 'CPU',
      deviceType: 'cpu',
      dtype: 'float32',
      attention: 'block',
      torch: 'test',
      shape: CPU_SHAPE,
      maxTokens: 16384,
      workloads: [same(workload('a', 4)), workload('b', 9), same(workload('c', 20))],
    };
    const step = analyzeStep(section);
    expect(step.text).toContain('(merged = naive)');
    expect(step.text.match(/= naive: the merge joined no call/g)).toHaveLength(2);
    expect(step.text).toContain('leave-one-workload-out, 7 steps'); // 2 + 3 + 2 timed sides
    expect(step.rows[0].sides.merged.predicted).toBeUndefined();
  });

  it('states the GPU goal on CUDA for workloads of at least 50x compression, and lists skipped workloads', () => {
    const skipped: StepWorkload = {
      name: 'z',
      compression: 85,
      packSeconds: 0.1,
      report: { naiveTokens: 3000, packedTokens: 35 } as StepWorkload['report'],
      skipped: 'timed on cuda hosts only',
    };
    const section: StepSection = {
      device: 'GPU',
      deviceType: 'cuda',
      dtype: 'bfloat16',
      attention: 'flex',
      torch: 'test',
      shape: CPU_SHAPE,
      maxTokens: 16384,
      workloads: [workload('a', 9), workload('b', 60), skipped],
    };
    const step = analyzeStep(section);
    // b: naive 48 s + 30 micro-batches × 0.05 s against packed 0.85 s, about 58×.
    expect(step.text.match(/GPU goal \(≥ 40× step speedup at ≥ 50× compression\): [\d.]+×, met/g)).toHaveLength(1);
    expect(step.text).toContain('z: skipped: timed on cuda hosts only (3,000 naive → 35 packed tokens');
    expect(step.rows.map((r) => r.name)).toEqual(['a', 'b']);
    const cpu = analyzeStep({ ...section, deviceType: 'cpu' });
    expect(cpu.text).not.toContain('GPU goal');
  });
});

describe('tile-level ideal and MFU', () => {
  // A one-layer model small enough to count by hand: hidden 4, one head of 4, MLP 8, a 10-row LM head.
  // Weights per layer: q 4·4 + k, v 2·4·4 + o 4·4 + MLP 3·4·8 = 160, so 2·160 = 320 FLOPs per token forward; the head
  // 2·4·10 = 80 per scored row; attention 4·1·4 = 16 per pair forward. Step = 3 × forward.
  const shape: ModelShape = { name: 'hand', hidden: 4, intermediate: 8, layers: 1, heads: 1, kv_heads: 1, head_dim: 4 };
  const fig = (tokens: number, pairs: number, tiles: number, maxTokens: number): SideFigures => ({
    micro_batches: 1,
    tokens,
    occurrences: tokens,
    trainable: 100,
    pairs,
    blocks: tiles,
    full_blocks: 0,
    executed_blocks: tiles,
    scored_rows: 100,
    max_tokens: maxTokens,
  });
  // naive: 1000 tokens, 50,000 pairs, 10 tiles; packed: 250 tokens, 20,000 pairs, 4 tiles.
  const naivePairs = 3 * (320 * 1000 + 80 * 100 + 16 * 50_000); // 3,384,000
  const naiveTiles = 3 * (320 * 1000 + 80 * 100 + 16 * 128 * 128 * 10); // 8,848,320
  const packedPairs = 3 * (320 * 250 + 80 * 100 + 16 * 20_000); // 1,224,000
  const packedTiles = 3 * (320 * 250 + 80 * 100 + 16 * 128 * 128 * 4); // 3,409,728
  const tileIdeal = naiveTiles / packedTiles; // ≈ 2.595
  const pairIdeal = naivePairs / packedPairs; // ≈ 2.765
  const NAIVE_S = 1e-8;
  function hand(name: string, packedMaxTokens: number, speedup: number): StepWorkload {
    const side = (step: number, attention: string) => ({
      step,
      masks: 0,
      forward: 0,
      loss: 0,
      backward: 0,
      steps: [step],
      peak_bytes: null,
      loss_value: 0.5,
      logprob_sum: -1,
      grad_norm: 1,
      attention,
    });
    const naive = fig(1000, 50_000, 10, 1000),
      packed = fig(250, 20_000, 4, packedMaxTokens);
    return {
      name,
      compression: 4,
      packSeconds: 0,
      report: { timelines: 4, samples: 4 } as StepWorkload['report'],
      shape,
      vocab: 10,
      mismatches: {},
      figures: { naive, merged: naive, packed },
      sides: {
        naive: side(NAIVE_S, 'stock'),
        merged: { ...side(NAIVE_S, 'stock'), same_as_naive: true },
        packed: side(NAIVE_S / speedup, 'tree'),
      },
    };
  }
  const gpu: StepSection = {
    device: 'NVIDIA H100 80GB HBM3',
    deviceType: 'cuda',
    dtype: 'bfloat16',
    attention: 'flex',
    torch: 'test',
    shape,
    maxTokens: 16384,
    naiveAttention: 'transformers sdpa (one sequence per call, is_causal)',
    packedAttention: 'treepack FlexAttention + BlockMask',
    // 0.85 × the tile ideal in the goal's range; the same below 8k tokens (no goal stated); 0.7 × in range (missed).
    workloads: [hand('in range', 9000, 0.85 * tileIdeal), hand('small', 4000, 0.85 * tileIdeal), hand('slow', 16384, 0.7 * tileIdeal)],
  };

  it('divides the step FLOPs at tiles visited, naive by packed, and states the goal against it on a GPU', () => {
    const { rows, text, peak } = analyzeStep(gpu);
    expect(peak).toEqual({ name: 'H100 SXM', flops: 989e12 });
    expect(rows[0].tileIdealRatio).toBeCloseTo(tileIdeal, 12);
    expect(rows[0].idealRatio).toBeCloseTo(pairIdeal, 12);
    expect(rows.map((r) => r.goal.met)).toEqual([true, null, false]);
    expect(rows[0].goal.ideal).toBe('tiles');
    expect(rows[0].goal.ratio).toBeCloseTo(0.85, 12);
    expect(text).toContain('step 0.85 × the tile-level ideal (goal ≥ 0.8 at 8k–32k-token micro-batches: met)');
    expect(text).toContain(
      'step 0.85 × the tile-level ideal (goal ≥ 0.8 at 8k–32k-token micro-batches: not stated: ' +
        'packed micro-batches of up to 4000 tokens',
    );
    expect(text).toContain('step 0.70 × the tile-level ideal (goal ≥ 0.8 at 8k–32k-token micro-batches: MISSED)');
    expect(text).toContain('naive and merged attention: transformers sdpa (one sequence per call, is_causal)');
  });

  it('reports MFU of both sides against the device peak, attention at useful pairs and at tiles visited', () => {
    const { naive, packed } = analyzeStep(gpu).rows[0].sides;
    expect(naive.flops).toEqual({ pairs: naivePairs, tiles: naiveTiles });
    expect(naive.mfu!.pairs).toBeCloseTo(naivePairs / (NAIVE_S * 989e12), 12); // 0.342
    expect(naive.mfu!.tiles).toBeCloseTo(naiveTiles / (NAIVE_S * 989e12), 12); // 0.895
    const packedS = NAIVE_S / (0.85 * tileIdeal);
    expect(packed.mfu!.tiles).toBeCloseTo(packedTiles / (packedS * 989e12), 12);
    expect(packed.achieved.pairs).toBeCloseTo(packedPairs / packedS, 0);
    expect(analyzeStep(gpu).text).toContain(`MFU (attention at useful pairs / at tiles visited): naive 34.2% / 89.5%, packed`);
  });

  it('reports achieved FLOP/s and the pair-level goal on a CPU, and no MFU without a peak', () => {
    const cpu = analyzeStep({ ...gpu, device: 'CPU, 2 threads', deviceType: 'cpu', dtype: 'float32' });
    expect(cpu.peak).toEqual({ reason: expect.stringContaining('CPU') });
    const r = cpu.rows[0];
    expect(r.sides.naive.mfu).toBeUndefined();
    expect(r.sides.naive.achieved.tiles).toBeCloseTo(naiveTiles / NAIVE_S, 0);
    // 0.85 × the tile ideal is 0.85 × 2.595 / 2.765 = 0.798 of the pair ideal: short of the CPU goal.
    expect(r.goal).toEqual({ ideal: 'pairs', ratio: expect.closeTo((0.85 * tileIdeal) / pairIdeal, 12), met: false });
    // 3,384,000 and 8,848,320 FLOPs in 10 ns
    expect(cpu.text).toContain('achieved (attention at useful pairs / at tiles visited): naive 338400.0 / 884832.0 GFLOP/s');
    expect(cpu.text).not.toContain('tile-level ideal (goal');
  });

  it('knows the peak of the devices in its table, and says why it has none for others', () => {
    expect(devicePeak('NVIDIA H200', 'cuda', 'bfloat16')).toEqual({ name: 'H200', flops: 989e12 });
    expect(devicePeak('NVIDIA H100 PCIe', 'cuda', 'bfloat16')).toEqual({ name: 'H100 PCIe', flops: 756e12 });
    expect(devicePeak('NVIDIA A100-SXM4-80GB', 'cuda', 'bfloat16')).toEqual({ name: 'A100', flops: 312e12 });
    expect(devicePeak('NVIDIA L40S', 'cuda', 'bfloat16')).toEqual({ name: 'L40S', flops: 362e12 });
    expect(devicePeak('NVIDIA L4', 'cuda', 'bfloat16')).toEqual({ name: 'L4', flops: 121e12 });
    expect(devicePeak('NVIDIA GeForce RTX 3090', 'cuda', 'bfloat16')).toEqual({ reason: expect.stringContaining('not in the peak table') });
    expect(devicePeak('NVIDIA H100 80GB HBM3', 'cuda', 'float32')).toEqual({ reason: expect.stringContaining('float32') });
    const unknown = analyzeStep({ ...gpu, device: 'NVIDIA GeForce RTX 3090' });
    expect(unknown.rows[0].sides.naive.mfu).toBeUndefined();
    expect(unknown.text).toContain('(step seconds × peak): not reported, NVIDIA GeForce RTX 3090 is not in the peak table');
  });
});
