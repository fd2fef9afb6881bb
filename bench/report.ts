/**
 * The bench report as one self-contained HTML page: Vega-Lite specs compiled and rendered to SVG in Node (vega's
 * headless View), inlined, so the page needs no script and no network. Each figure is a <figure data-figure=…>
 * with its data row count, which test/bench-report.test.ts checks in Chromium.
 */
import * as vega from 'vega';
import { compile, type TopLevelSpec } from 'vega-lite';
import type { LossBenchRow } from './loss.js';
import type { MaskSparsity } from './masks.js';
import type { MergeBenchRow } from './merge.js';
import type { StepAnalysis } from './step-report.js';

/** What the figures are drawn from: the parts of the bench's JSON the page shows. */
export interface ReportData {
  title: string;
  generated: string;
  environment: string[];
  step: { device: string; rows: StepAnalysis[] } | { skipped: string };
  sparsity: MaskSparsity[];
  loss: LossBenchRow[];
  merge: MergeBenchRow[];
}

interface Figure {
  id: string;
  title: string;
  caption: string;
  rows: number;
  spec?: TopLevelSpec;
  skipped?: string;
}

const WIDTH = 520,
  HEIGHT = 300;

function figures(d: ReportData): Figure[] {
  const out: Figure[] = [];
  if ('skipped' in d.step) {
    const why = `skipped: ${d.step.skipped}`;
    out.push({ id: 'step-speedup', title: 'Step speedup vs token compression', caption: why, rows: 0, skipped: why });
    out.push({ id: 'step-breakdown', title: 'Step time breakdown', caption: why, rows: 0, skipped: why });
  } else {
    const rows = d.step.rows;
    const points = rows.flatMap((r) => [
      { workload: r.name, compression: r.compression, value: r.speedup, series: 'measured step speedup (naive ÷ packed)' },
      { workload: r.name, compression: r.compression, value: r.idealRatio, series: 'ideal work ratio (FLOPs at useful pairs)' },
      { workload: r.name, compression: r.compression, value: r.tileIdealRatio, series: 'tile-level ideal (FLOPs at tiles visited)' },
    ]);
    const hi = Math.max(...rows.map((r) => r.compression), 2) * 1.2;
    out.push({
      id: 'step-speedup',
      title: 'Step speedup vs token compression',
      caption:
        `${d.step.device}. The diagonal is the token compression (naive ÷ packed tokens); attention pairs shrink less than tokens ` +
        `on long shared contexts, so the ideal work ratio sits below it; the tile-level ideal counts the 128×128 tiles ` +
        `each side's attention kernel visits.`,
      rows: points.length,
      spec: {
        width: WIDTH,
        height: HEIGHT,
        layer: [
          {
            data: {
              values: [
                { x: 1, y: 1 },
                { x: hi, y: hi },
              ],
            },
            mark: { type: 'line', strokeDash: [4, 4], color: '#888' },
            encoding: {
              x: { field: 'x', type: 'quantitative', scale: { type: 'log' } },
              y: { field: 'y', type: 'quantitative', scale: { type: 'log' } },
            },
          },
          {
            data: { values: points },
            mark: { type: 'point', filled: true, size: 90 },
            encoding: {
              x: { field: 'compression', type: 'quantitative', scale: { type: 'log' }, title: 'token compression (naive ÷ packed tokens)' },
              y: { field: 'value', type: 'quantitative', scale: { type: 'log' }, title: 'naive ÷ packed' },
              color: { field: 'series', type: 'nominal', legend: { orient: 'bottom', title: null } },
              shape: { field: 'series', type: 'nominal' },
              tooltip: [{ field: 'workload' }, { field: 'value', format: '.2f' }],
            },
          },
        ],
      },
    });
    const stages = rows.flatMap((r) =>
      (['naive', 'merged', 'packed'] as const).flatMap((side) => {
        const s = r.sides[side];
        if (s.sameAsNaive) return []; // naive's figures, not a measurement of its own
        const parts: [string, number][] = [
          ['masks', s.masks],
          ['forward', s.forward],
          ['loss', s.loss],
          ['backward', s.backward],
        ];
        if (side === 'packed') parts.unshift(['pack', r.packSeconds]);
        return parts.map(([stage, seconds]) => ({ workload: r.name, side, stage, seconds }));
      }),
    );
    out.push({
      id: 'step-breakdown',
      title: 'Step time breakdown',
      caption: `${d.step.device}. Seconds per step by stage; pack is treepack's packing of the workload (library, native backend), paid once per batch.`,
      rows: stages.length,
      spec: {
        data: { values: stages },
        facet: { row: { field: 'workload', type: 'nominal', header: { labelAngle: 0, labelAlign: 'left', title: null } } },
        spec: {
          width: WIDTH,
          height: 60,
          mark: 'bar',
          encoding: {
            y: { field: 'side', type: 'nominal', sort: ['naive', 'merged', 'packed'], title: null },
            x: { field: 'seconds', type: 'quantitative', title: 'seconds per step' },
            color: {
              field: 'stage',
              type: 'nominal',
              sort: ['pack', 'masks', 'forward', 'loss', 'backward'],
              legend: { orient: 'bottom' },
            },
            order: { field: 'stage' },
          },
        },
        resolve: { scale: { x: 'independent' } },
      },
    });
  }
  const sparsity = d.sparsity.flatMap((s) => [
    { N: s.N, series: `tiles skipped (B = ${s.blockSize})`, fraction: s.skippedFraction },
    { N: s.N, series: 'visible pairs ÷ causal pairs', fraction: s.visibleFraction },
  ]);
  out.push({
    id: 'sparsity',
    title: 'Block sparsity of the tree mask vs N',
    caption: 'Generated agent forests cut at N nodes (bench/masks.ts), js backend.',
    rows: sparsity.length,
    spec: {
      width: WIDTH,
      height: HEIGHT,
      data: { values: sparsity },
      mark: { type: 'line', point: true },
      encoding: {
        x: { field: 'N', type: 'quantitative', scale: { type: 'log' }, title: 'packed tokens N' },
        y: { field: 'fraction', type: 'quantitative', scale: { domain: [0, 1] } },
        color: { field: 'series', type: 'nominal', legend: { orient: 'bottom', title: null } },
      },
    },
  });
  const loss = d.loss
    .filter((r) => r.mode !== 'validate' && r.mode !== 'copy')
    .map((r) => ({ M: r.M, rate: r.occurrencesPerSecond, series: `${r.backend}, ${r.mode}` }));
  out.push({
    id: 'loss-throughput',
    title: 'Loss throughput per backend',
    caption: 'Forward + backward of the packed RL loss, occurrences per second (bench/loss.ts); the backend and mode name each line.',
    rows: loss.length,
    spec: {
      width: WIDTH,
      height: HEIGHT,
      data: { values: loss },
      mark: { type: 'line', point: true },
      encoding: {
        x: { field: 'M', type: 'quantitative', scale: { type: 'log' }, title: 'occurrences M' },
        y: { field: 'rate', type: 'quantitative', scale: { type: 'log' }, title: 'occurrences per second' },
        color: { field: 'series', type: 'nominal', legend: { orient: 'bottom', title: null, columns: 2 } },
      },
    },
  });
  const merge = d.merge.flatMap((r) => [
    { timelines: r.timelines, seconds: r.treepack.seconds, series: `treepack (${r.scope})`, dataset: r.dataset },
    { timelines: r.timelines, seconds: r.agentjet.seconds, series: `pairwise greedy, AgentJet-style (${r.scope})`, dataset: r.dataset },
  ]);
  out.push({
    id: 'merge-time',
    title: 'Timeline merge time vs number of timelines',
    caption: 'Same timelines, same run (bench/merge.ts), js.',
    rows: merge.length,
    spec: {
      width: WIDTH,
      height: HEIGHT,
      data: { values: merge },
      mark: { type: 'point', filled: true, size: 80 },
      encoding: {
        x: { field: 'timelines', type: 'quantitative', scale: { type: 'log' }, title: 'timelines' },
        y: { field: 'seconds', type: 'quantitative', scale: { type: 'log' }, title: 'merge seconds' },
        color: { field: 'series', type: 'nominal', legend: { orient: 'bottom', title: null } },
        tooltip: [{ field: 'dataset' }, { field: 'seconds', format: '.4f' }],
      },
    },
  });
  return out;
}

async function svgOf(spec: TopLevelSpec): Promise<string> {
  const withConfig = { ...spec, config: { legend: { labelLimit: 0 } } } as TopLevelSpec; // full series names
  const view = new vega.View(vega.parse(compile(withConfig).spec), { renderer: 'none' });
  return view.toSVG();
}

const escape = (s: string) => s.replace(/[&<>"]/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' })[c]!);

/** The page; `tables` are preformatted text blocks (the terminal's step table) shown under the figures. */
export async function renderHtml(d: ReportData, tables: string[]): Promise<string> {
  const parts: string[] = [];
  for (const f of figures(d)) {
    const body = f.spec && f.rows > 0 ? await svgOf(f.spec) : `<p class="skipped">${escape(f.skipped ?? 'no data in this run')}</p>`;
    parts.push(
      `<figure data-figure="${f.id}" data-rows="${f.rows}"><h2>${escape(f.title)}</h2>${body}<figcaption>${escape(f.caption)}</figcaption></figure>`,
    );
  }
  return `<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>${escape(d.title)}</title>
<style>
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1180px;color:#222}
main{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:1.5em}
figure{margin:0;padding:1em;border:1px solid #ddd;border-radius:6px}
h2{font-size:1.05em;margin:0 0 .5em}figcaption{color:#555;font-size:.9em}
pre{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:12px}.skipped{color:#a40}
</style></head><body>
<h1>${escape(d.title)}</h1>
<p>${escape(d.generated)}</p>
<ul>${d.environment.map((e) => `<li>${escape(e)}</li>`).join('')}</ul>
<main>${parts.join('\n')}</main>
${tables.map((t) => `<pre>${escape(t)}</pre>`).join('\n')}
</body></html>
`;
}
