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
import type { SideFigures } from '../bench/cost-model.js';

const CHROMIUM = process.env.TREEPACK_CHROMIUM ?? '/usr/bin/chromium';
const required = process.env.TREEPACK_REQUIRE_CHROMIUM === '1';
const have = existsSync(CHROMIUM);
if (!have) console.warn(`bench report test: skipped, no Chromium at ${CHROMIUM} (apt-get install chromium, or set TREEPACK_CHROMIUM)`);

/** A workload whose packed side holds 1/c of the naive tokens; step times follow a fixed rate per token. */
function workload(name: string, c: number): StepWorkload {
  const side = (tokens: number, mbs: number): SideFigures => ({ micro_batches: mbs, tokens, occurrences: tokens, trainable: 500, pairs: tokens * 900, blocks: Math.ceil((tokens * 900) / 128 / 128) + tokens / 128, full_blocks: 0, scored_rows: 500, max_tokens: 16384 });
  const f = { naive: side(8000 * c, Math.ceil(c / 2)), merged: side(16000, 1), packed: side(8000, 1) };
  const time = (s: SideFigures) => ({ step: s.tokens * 1e-4 + s.micro_batches * 0.05, masks: 0.01, forward: s.tokens * 3e-5, loss: 0.001, backward: s.tokens * 6e-5, steps: [1], peak_bytes: s.tokens * 4096, logprob_sum: -1, grad_norm: 1 });
  return {
    name, compression: c, packSeconds: 0.2, report: { timelines: 8 * c, samples: 8 } as StepWorkload['report'], figures: f,
    sides: { naive: { ...time(f.naive), loss_value: 0.5 }, merged: { ...time(f.merged), loss_value: 0.5 }, packed: { ...time(f.packed), loss_value: 0.5 } },
    mismatches: {},
  };
}

describe.skipIf(!have && !required)('bench report in Chromium', () => {
  it('renders every figure with data and no console errors', { timeout: 120_000 }, async () => {
    expect(have, `Chromium required (TREEPACK_REQUIRE_CHROMIUM=1) but ${CHROMIUM} is missing`).toBe(true);
    const section: StepSection = { device: 'CPU, 2 threads', deviceType: 'cpu', dtype: 'float32', attention: 'block', torch: 'test', shape: CPU_SHAPE, maxTokens: 16384, workloads: [workload('a', 4), workload('b', 9), workload('c', 20)] };
    const step = analyzeStep(section);
    expect(step.rows).toHaveLength(3);
    expect(step.modelError!.max).toBeLessThan(0.05); // times are linear in the model's own features: near exact
    const data: ReportData = {
      title: 'treepack bench (test)', generated: 'test', environment: ['test'],
      step: { device: 'CPU (test)', rows: step.rows },
      sparsity: [1024, 4096, 16384].map((N) => ({ N, blockSize: 128, causalBlocks: 100, listedBlocks: 40, fullBlocks: 10, skippedFraction: 0.6, visibleFraction: 0.3 })),
      loss: [1e4, 1e5].flatMap((M) => ['js', 'cpu'].map((backend) => ({ M, N: M / 4, backend, mode: 'compact' as const, seconds: 0.01, occurrencesPerSecond: M * 100, gbPerSecond: 1 }))),
      merge: [10, 100].map((t) => ({ dataset: 'generated', scope: 'one pool' as const, timelines: t, treepack: { samples: 1, packedTokens: 1, naiveTokens: 1, seconds: t * 1e-4, wrongMerges: 0 }, agentjet: { samples: 1, packedTokens: 1, naiveTokens: 1, seconds: t * t * 1e-5, wrongMerges: 0 } })),
    };
    const dir = mkdtempSync(join(tmpdir(), 'treepack-report-'));
    const page = join(dir, 'report.html');
    writeFileSync(page, await renderHtml(data, [step.text]));

    const { chromium } = await import('playwright-core');
    const browser = await chromium.launch({
      executablePath: CHROMIUM,
      args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update', '--no-first-run'],
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
  it('reports a merged side that is naive\'s (the merge joined no call) as naive, outside the fit and its error', () => {
    const same = (w: StepWorkload): StepWorkload => {
      const sides = w.sides!;
      return { ...w, figures: { ...w.figures!, merged: w.figures!.naive }, sides: { ...sides, merged: { ...sides.naive, same_as_naive: true } } };
    };
    const section: StepSection = { device: 'CPU', deviceType: 'cpu', dtype: 'float32', attention: 'block', torch: 'test', shape: CPU_SHAPE, maxTokens: 16384, workloads: [same(workload('a', 4)), workload('b', 9), same(workload('c', 20))] };
    const step = analyzeStep(section);
    expect(step.text).toContain('(merged = naive)');
    expect(step.text.match(/= naive: the merge joined no call/g)).toHaveLength(2);
    expect(step.text).toContain('leave-one-workload-out, 7 steps'); // 2 + 3 + 2 timed sides
    expect(step.rows[0].sides.merged.predicted).toBeUndefined();
  });

  it('states the GPU goal on CUDA for workloads of at least 50x compression, and lists skipped workloads', () => {
    const skipped: StepWorkload = { name: 'z', compression: 85, packSeconds: 0.1, report: { naiveTokens: 3000, packedTokens: 35 } as StepWorkload['report'], skipped: 'timed on cuda hosts only' };
    const section: StepSection = { device: 'GPU', deviceType: 'cuda', dtype: 'bfloat16', attention: 'flex', torch: 'test', shape: CPU_SHAPE, maxTokens: 16384, workloads: [workload('a', 9), workload('b', 60), skipped] };
    const step = analyzeStep(section);
    // b: naive 48 s + 30 micro-batches × 0.05 s against packed 0.85 s, about 58×.
    expect(step.text.match(/GPU goal \(≥ 40× step speedup at ≥ 50× compression\): [\d.]+×, met/g)).toHaveLength(1);
    expect(step.text).toContain('z: skipped: timed on cuda hosts only (3,000 naive → 35 packed tokens');
    expect(step.rows.map((r) => r.name)).toEqual(['a', 'b']);
    const cpu = analyzeStep({ ...section, deviceType: 'cpu' });
    expect(cpu.text).not.toContain('GPU goal');
  });
});
