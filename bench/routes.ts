/**
 * What one route per node costs (src/pack/routes.ts): the default pre-tokenized bench data with MoE routes as an
 * engine would return them (each token routed by its prefix, so calls that share a prefix agree; the last token of
 * every call unrouted, as vLLM returns them), then a fraction of every call's prompt tokens rerouted (a later call
 * reading the prompt anew and routing some tokens otherwise). Per fraction: packed tokens when the forest splits
 * where routes differ, against sharing by tokens alone, and the packing time against the same samples without routes.
 */
import { packRecords } from '../src/index.js';
import type { TokenSampleJson } from './dataset.js';
import { generateTokenSamples } from './dataset.js';
import { fmt } from './format.js';

/** A Qwen3-MoE-like top-k over 128 experts, on 4 MoE layers (the split depends on the rows differing, not on L). */
const LAYERS = 4,
  TOP_K = 8,
  EXPERTS = 128;

export interface RoutesBenchRow {
  rerouted: number; // fraction of each call's prompt tokens routed anew
  policy: 'split' | 'first';
  naiveTokens: number;
  unsplitTokens: number; // packed sharing by tokens alone
  splitTokens: number; // packed as the policy packs
  conflicts: number;
  packSeconds: number;
  packSecondsWithoutRoutes: number;
}

/** The samples with `routes` in the compact form (base64 int16), `rerouted` of each prompt's tokens routed anew. */
function withRoutes(samples: TokenSampleJson[], rerouted: number, seed: number): object[] {
  let state = seed >>> 0;
  const random = () => (state = (Math.imul(state, 1664525) + 1013904223) >>> 0) / 2 ** 32;
  return samples.map((s) => {
    const T = s.tokens.length - 1; // the last token unrouted
    const prompt = s.loss_mask.indexOf(1) < 0 ? T : s.loss_mask.indexOf(1);
    const rows = new Int16Array(T * LAYERS * TOP_K);
    let h = 0x811c9dc5;
    for (let t = 0; t < T; t++) {
      h = Math.imul(h ^ s.tokens[t], 0x01000193) >>> 0;
      const key = t < prompt && random() < rerouted ? Math.floor(random() * 2 ** 32) : h;
      for (let l = 0; l < LAYERS; l++) {
        const first = (key >>> (l * 7)) % EXPERTS;
        for (let j = 0; j < TOP_K; j++) rows[(t * LAYERS + l) * TOP_K + j] = (first + j) % EXPERTS;
      }
    }
    const data = Buffer.from(rows.buffer, rows.byteOffset, rows.byteLength).toString('base64');
    return { ...s, routes: { dtype: 'int16', shape: [T, LAYERS, TOP_K], data } };
  });
}

async function pack(records: object[], routeConflict: 'split' | 'first') {
  const run = packRecords(records, { advantages: 'none', routeConflict });
  for await (const _ of run);
  return run.report();
}

export async function benchRoutes(quick: boolean): Promise<RoutesBenchRow[]> {
  const groups = quick ? 2 : 8;
  const samples = [...generateTokenSamples({ groups, seed: 7 })];
  console.log(
    `\n## MoE routes: one route per node (${groups} groups × 8 episodes, ${samples.length} calls; ${LAYERS} layers × top-${TOP_K} of ${EXPERTS}, last token unrouted)`,
  );
  const plain = await pack(samples, 'split');
  const rows: RoutesBenchRow[] = [];
  for (const [rerouted, policy] of [
    [0, 'split'],
    [0.001, 'split'],
    [0.01, 'split'],
    [0.01, 'first'],
  ] as const) {
    const r = await pack(withRoutes(samples, rerouted, 3), policy);
    const routes = r.routes!;
    const row = {
      rerouted,
      policy,
      naiveTokens: r.naiveTokens,
      unsplitTokens: routes.unsplitTokens,
      splitTokens: routes.splitTokens,
      conflicts: routes.conflicts,
      packSeconds: r.seconds.pack,
      packSecondsWithoutRoutes: plain.seconds.pack,
    };
    rows.push(row);
    console.log(
      `  ${fmt(100 * rerouted, 1).padStart(4)}% of prompt tokens rerouted, ${policy.padEnd(5)}: packed ${row.splitTokens} vs ${row.unsplitTokens} by tokens alone ` +
        `(+${fmt((100 * (row.splitTokens - row.unsplitTokens)) / row.unsplitTokens, 1)}%; naive ${row.naiveTokens}), ${row.conflicts} occurrences routed unlike their node's first; ` +
        `pack ${fmt(row.packSeconds, 2)} s vs ${fmt(row.packSecondsWithoutRoutes, 2)} s without routes`,
    );
  }
  return rows;
}
