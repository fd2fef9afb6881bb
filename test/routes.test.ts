/**
 * One route per node (src/pack/routes.ts): routed samples packed on every backend give the forest whose nodes are
 * (token, route) prefixes, checked against a brute-force trie of such prefixes, on random batches with controlled
 * disagreement and on adversarial ones; the `first` policy; the planner under a budget; the micro-batch tensor
 * `routes` written and read back, and refused when malformed, naming the field.
 */
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { resolveKernel, type BackendName } from '../src/backend/index.js';
import { TreepackError } from '../src/errors.js';
import { readMicroBatch, writeMicroBatch } from '../src/io/microbatch.js';
import { writeSafetensors, readSafetensors } from '../src/io/safetensors.js';
import { assembleMicroBatch, toSequences } from '../src/pack/batch.js';
import type { MicroBatch } from '../src/pack/contract.js';
import { packForest } from '../src/pack/forest.js';
import { checkForest } from '../src/pack/invariants.js';
import type { RouteConflictPolicy, RouteStats } from '../src/pack/routes.js';
import { packWindow } from '../src/pack/window.js';
import type { Sample } from '../src/records/types.js';
import { describeBackends } from './helpers/backends.js';
import { cli } from './helpers/cli.js';
import { randomBatch, rng, shuffle } from './helpers/sequences.js';

const L = 2,
  K = 2,
  E = 5;
const R = L * K;

const dir = mkdtempSync(join(tmpdir(), 'treepack-routes-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** A route row: K distinct experts per layer, from a seed. */
function routeRow(seed: number): number[] {
  const r = rng(seed);
  const row: number[] = [];
  for (let l = 0; l < L; l++) {
    const a = Math.floor(r() * E);
    row.push(a, (a + 1 + Math.floor(r() * (E - 1))) % E);
  }
  return row;
}

function sample(id: string, tokens: number[], rows: (number[] | undefined)[] | undefined): Sample {
  const s: Sample = {
    kind: 'sample',
    id,
    group: 'g',
    episode: id,
    tokens: Int32Array.from(tokens),
    loss_mask: new Uint8Array(tokens.length).fill(1),
    source: { file: 'in.jsonl', line: 1 },
  };
  if (rows) s.routes = { layers: L, topK: K, experts: Int16Array.from(rows.flatMap((r) => r ?? new Array<number>(R).fill(-1))) };
  return s;
}

/**
 * Routes as an engine gives them: a token's route is a function of its prefix (so shared prefixes agree), except
 * that a sequence re-routes each token with probability `disagree` (a later call reading the prompt anew), and
 * leaves its last token unrouted with probability `unrouted` (vLLM).
 */
function routed(seqs: number[][], seed: number, disagree: number, unrouted = 0): Sample[] {
  const r = rng(seed);
  return seqs.map((tokens, i) => {
    let h = 17;
    const rows = tokens.map((tok) => {
      h = (Math.imul(h, 31) + tok + 1) | 0;
      return routeRow(r() < disagree ? Math.floor(r() * 1e9) : h);
    });
    if (tokens.length && r() < unrouted) rows[rows.length - 1] = new Array<number>(R).fill(-1);
    return sample(`s${i}`, tokens, rows);
  });
}

/** The definition: nodes are distinct (token, route) prefixes (`first`: token prefixes); N of the brute-force trie. */
function trieSize(samples: Sample[], byRoute: boolean): number {
  const nodes = new Map<string, number>();
  for (const s of samples) {
    let parent = -1;
    for (let t = 0; t < s.tokens.length; t++) {
      const route = byRoute ? Array.from(s.routes!.experts.subarray(t * R, (t + 1) * R)).join(',') : '';
      const key = `${parent}|${s.tokens[t]}|${route}`;
      let id = nodes.get(key);
      if (id === undefined) nodes.set(key, (id = nodes.size));
      parent = id;
    }
  }
  return nodes.size;
}

function row(mb: MicroBatch, p: number): number[] {
  return Array.from(mb.routes!.subarray(p * R, (p + 1) * R));
}

/** Checks a routed micro-batch against its samples under `policy`; returns it. */
function expectRouted(mb: MicroBatch, samples: Sample[], policy: RouteConflictPolicy): void {
  expect(checkForest(mb, toSequences(samples))).toEqual([]);
  expect(mb.input_ids.length).toBe(trieSize(samples, policy === 'split'));
  expect([mb.meta.routes_layers, mb.meta.routes_top_k]).toEqual([L, K]);
  let o = 0;
  const firstAt = new Map<number, number[]>();
  for (const s of samples)
    for (let t = 0; t < s.tokens.length; t++, o++) {
      const p = mb.seq_positions[o];
      const own = Array.from(s.routes!.experts.subarray(t * R, (t + 1) * R));
      if (!firstAt.has(p)) firstAt.set(p, own);
      // split: every occurrence replays exactly its own route; first: its node's first occurrence's
      expect(row(mb, p)).toEqual(policy === 'split' ? own : firstAt.get(p));
    }
  // Siblings stay in ascending token order (ties: one token routed two ways).
  for (let p = 1; p < mb.input_ids.length; p++) {
    const prev = mb.parent[p] === -1 ? -1 : mb.parent[p];
    for (let q = p - 1; q >= 0 && q > prev; q--)
      if (mb.parent[q] === mb.parent[p]) {
        expect(mb.input_ids[q]).toBeLessThanOrEqual(mb.input_ids[p]);
        break;
      }
  }
}

function sameBatch(a: MicroBatch, b: MicroBatch): void {
  for (const f of ['input_ids', 'position_ids', 'parent', 'subtree_end', 'seq_offsets', 'seq_positions', 'routes'] as const)
    expect(Array.from(a[f]!), f).toEqual(Array.from(b[f]!));
}

const assemble = async (backend: BackendName, samples: Sample[], routeConflict: RouteConflictPolicy = 'split', routeStats?: RouteStats) =>
  assembleMicroBatch(samples, {
    tokenizer: 'none',
    packForest: (await resolveKernel('packForest', backend)).kernel,
    routeConflict,
    routeStats,
  });

await describeBackends('packForest', (backend) => {
  it('random batches with 0%, 1% and 30% of tokens rerouted: nodes are (token, route) prefixes, each replaying exactly its own', async () => {
    for (let trial = 0; trial < 60; trial++) {
      const seqs = randomBatch(trial);
      for (const disagree of [0, 0.01, 0.3]) {
        const samples = routed(seqs, trial, disagree, 0.3);
        const stats = { conflicts: 0, unsplitTokens: 0, splitTokens: 0 };
        const mb = await assemble(backend, samples, 'split', stats);
        expectRouted(mb, samples, 'split');
        sameBatch(mb, await assemble('js', samples));
        expect(stats.unsplitTokens).toBe(packForest(toSequences(samples)).input_ids.length);
        expect(stats.splitTokens).toBe(mb.input_ids.length);
        if (disagree === 0 && stats.conflicts === 0) expect(mb.input_ids.length).toBe(stats.unsplitTokens);
        // The layout depends on the multiset of (token, route) sequences alone.
        const perm = shuffle([...samples.keys()], rng(trial));
        const again = await assemble(
          backend,
          perm.map((i) => samples[i]),
        );
        for (const f of ['input_ids', 'position_ids', 'parent', 'subtree_end'] as const)
          expect(Array.from(again[f]), f).toEqual(Array.from(mb[f]));
        expect(Array.from(again.routes!)).toEqual(Array.from(mb.routes!));
        // first: shared by tokens, the first occurrence's routes, every conflict counted
        const firstStats = { conflicts: 0, unsplitTokens: 0, splitTokens: 0 };
        const first = await assemble(backend, samples, 'first', firstStats);
        expectRouted(first, samples, 'first');
        expect(firstStats.conflicts).toBe(stats.conflicts);
        expect(first.input_ids.length).toBe(stats.unsplitTokens);
      }
    }
  });

  it('adversarial: a conflict at token 0, at the last shared token, three route sets at one node, an unrouted last token', async () => {
    const a = routeRow(1),
      b = routeRow(2),
      c = routeRow(3),
      d = routeRow(4);
    expect(new Set([a, b, c, d].map(String)).size).toBe(4);
    const cases: [string, Sample[], number][] = [
      // token 0 routed two ways: two roots of one token
      ['token 0', [sample('x', [7, 8], [a, b]), sample('y', [7, 8], [b, b])], 4],
      // [1, 2, 3] shared, the routes of 3 differ: the split is at the last shared token
      ['last shared token', [sample('x', [1, 2, 3, 4], [a, a, a, b]), sample('y', [1, 2, 3, 5], [a, a, c, b])], 6],
      // three sequences, three route sets at token 2
      ['three sets', [sample('x', [1, 2, 3], [a, b, c]), sample('y', [1, 2, 3], [a, c, c]), sample('z', [1, 2, 4], [a, d, c])], 7],
      // call 1 ends in an unrouted token that call 2 re-reads routed: one extra node, the rest shared
      ['unrouted', [sample('x', [1, 2, 3], [a, b, undefined]), sample('y', [1, 2, 3, 4], [a, b, c, d])], 5],
      // identical sequences with identical routes: fully shared
      ['duplicates', [sample('x', [1, 2], [a, b]), sample('y', [1, 2], [a, b])], 2],
    ];
    for (const [name, samples, N] of cases) {
      const mb = await assemble(backend, samples);
      expect(mb.input_ids.length, name).toBe(N);
      expectRouted(mb, samples, 'split');
      sameBatch(mb, await assemble('js', samples));
    }
    const unrouted = await assemble(backend, cases[3][1]);
    expect(row(unrouted, unrouted.seq_positions[2])).toEqual([-1, -1, -1, -1]);
  });

  it('refuses routes on some samples only, or of two shapes, naming the record and field', async () => {
    const mixed = [sample('x', [1, 2], [routeRow(1), routeRow(2)]), sample('y', [1, 3], undefined)];
    const e = await assemble(backend, mixed).catch((err: unknown) => err);
    expect(e).toBeInstanceOf(TreepackError);
    expect((e as TreepackError).where).toMatchObject({ record: 'y', field: 'routes' });
    expect((e as TreepackError).message).toMatch(/sample "x" has routes but this one has none/);
    const other = sample('z', [1], undefined);
    other.routes = { layers: 1, topK: K, experts: Int16Array.from([0, 1]) };
    const e2 = await assemble(backend, [mixed[0], other]).catch((err: unknown) => err);
    expect((e2 as TreepackError).where).toMatchObject({ record: 'z', field: 'routes' });
    expect((e2 as TreepackError).message).toMatch(/1 layers × top-2, but sample "x" has 2 × top-2/);
  });
});

describe('routes under a token budget', () => {
  it('the plan counts the split forest: micro-batches as planned, with dp, padding and prefix reuse', async () => {
    const packForestJs = (await resolveKernel('packForest', 'js')).kernel;
    let cached = 0;
    for (let trial = 0; trial < 20; trial++) {
      const samples = routed(randomBatch(100 + trial, { count: 30, maxLen: 30 }), trial, 0.05, 0.5);
      const longest = Math.max(1, ...samples.map((s) => s.tokens.length));
      for (const budget of [
        { maxTokens: longest + 10, dp: 2, padMultiple: 4 },
        { maxTokens: 12, dp: 1, prefixCacheTokens: 1000 },
      ]) {
        // packWindow itself refuses a micro-batch whose forest is not the planned size (E_BACKEND)
        const w = packWindow(samples, { ...budget, tokenizer: 'none', packForest: packForestJs });
        let seen = 0;
        for (const { batch, samples: members } of w.microBatches) {
          const pad = batch.meta.num_pad_tokens ?? 0;
          const N = batch.input_ids.length;
          expect(checkForest(batch, toSequences(members))).toEqual([]);
          for (let p = N - pad; p < N; p++) expect(row(batch, p)).toEqual([-1, -1, -1, -1]);
          // every occurrence, cached prefixes included, replays exactly its own routes
          let o = 0;
          for (const s of members)
            for (let t = 0; t < s.tokens.length; t++, o++)
              expect(row(batch, batch.seq_positions[o])).toEqual(Array.from(s.routes!.experts.subarray(t * R, (t + 1) * R)));
          if ('prefixCacheTokens' in budget) cached += batch.meta.prefix_tokens ?? 0;
          seen += members.length;
        }
        expect(seen).toBe(samples.length);
      }
    }
    expect(cached).toBeGreaterThan(0); // the step plans did hang micro-batches from cached routed prefixes
  });
});

describe('the micro-batch tensor routes', () => {
  const samples = routed(randomBatch(7, { count: 8 }), 7, 0.2, 0.5);

  it('is written I16 [N, layers, k] with routes_layers/routes_top_k and read back', async () => {
    const mb = await assemble('js', samples);
    const path = join(dir, 'mb.safetensors');
    writeMicroBatch(path, mb);
    const raw = readSafetensors(path);
    expect(raw.tensors.get('routes')?.dtype).toBe('I16');
    expect(raw.tensors.get('routes')?.shape).toEqual([mb.input_ids.length, L, K]);
    expect([raw.metadata.routes_layers, raw.metadata.routes_top_k]).toEqual([String(L), String(K)]);
    const back = readMicroBatch(path).batch;
    expect(Array.from(back.routes!)).toEqual(Array.from(mb.routes!));
    expect([back.meta.routes_layers, back.meta.routes_top_k]).toEqual([L, K]);
    expect(readMicroBatch(path).extra.has('routes')).toBe(false);
  });

  it('a malformed one is refused on read, naming the field', async () => {
    const mb = await assemble('js', samples);
    const N = mb.input_ids.length;
    const good = join(dir, 'good.safetensors');
    writeMicroBatch(good, mb);
    const { tensors, metadata } = readSafetensors(good);
    const variants: [string, (t: typeof tensors, m: Record<string, string>) => void, string, RegExp][] = [
      ['dtype', (t) => t.set('routes', { dtype: 'I32', shape: [N, L, K], data: Int32Array.from(mb.routes!) }), 'routes', /dtype I32/],
      ['shape', (t) => t.set('routes', { dtype: 'I16', shape: [N, L * K], data: mb.routes! }), 'routes', /shape/],
      ['meta', (_, m) => (m.routes_top_k = '3'), 'routes', /expected \[N, routes_layers, routes_top_k\]/],
      ['meta text', (_, m) => (m.routes_layers = 'two'), 'routes_layers', /positive integer/],
      ['no meta', (_, m) => delete m.routes_layers, 'routes', /shape/],
      ['no tensor', (t) => t.delete('routes'), 'routes', /go together/],
      [
        'partial row',
        (t) => {
          const r = mb.routes!.slice();
          r[0] = -1;
          r[1] = 0;
          t.set('routes', { dtype: 'I16', shape: [N, L, K], data: r });
        },
        'routes',
        /routes\[0\]\[0\]\[0\] = -1/,
      ],
      [
        'twice',
        (t) => {
          const r = mb.routes!.slice();
          r[0] = 3;
          r[1] = 3;
          t.set('routes', { dtype: 'I16', shape: [N, L, K], data: r });
        },
        'routes',
        /routes\[0\]\[0\] holds expert 3 twice/,
      ],
    ];
    for (const [name, edit, field, message] of variants) {
      const t = new Map(tensors);
      const m = { ...metadata };
      edit(t, m);
      const path = join(dir, `bad-${name.replace(/ /g, '-')}.safetensors`);
      writeSafetensors(path, t, m);
      const e = (() => {
        try {
          readMicroBatch(path);
        } catch (err) {
          return err as TreepackError;
        }
        throw new Error(`${name}: expected a rejection`);
      })();
      expect(e.code, name).toBe('E_INPUT');
      expect(e.where, name).toEqual({ file: path, field });
      expect(e.message, name).toMatch(message);
    }
  });
});

describe('treepack pack and stats on routed input', () => {
  it('report what the split costs; --route-conflict first shares by tokens', () => {
    const samples = routed(randomBatch(3, { count: 20 }), 3, 0.2, 0.3);
    const lines = samples.map((s) => {
      const T = s.tokens.length;
      const rows = Array.from({ length: T }, (_, t) => Array.from(s.routes!.experts.subarray(t * R, (t + 1) * R)));
      // an unrouted last token is written as vLLM does: one row fewer
      const given = T && rows[T - 1][0] === -1 ? rows.slice(0, -1) : rows;
      // (nested JSON cannot say the shape of no rows: a one-token sequence without a route is written compact)
      const routes = given.length ? given.map((r) => [r.slice(0, K), r.slice(K)]) : { dtype: 'int16', shape: [0, L, K], data: '' };
      return JSON.stringify({ id: s.id, tokens: Array.from(s.tokens), routes });
    });
    const input = join(dir, 'in.jsonl');
    writeFileSync(input, lines.join('\n') + '\n');
    const split = trieSize(samples, true),
      byTokens = trieSize(samples, false);
    expect(split).toBeGreaterThan(byTokens);
    for (const policy of ['split', 'first'] as const) {
      const st = cli(['stats', input, '--json', '--route-conflict', policy, '--plan-tokens', '64', '--plan-dp', '1']);
      expect(st.code, st.stderr).toBe(0);
      const report = JSON.parse(st.stdout);
      expect(report.routes).toMatchObject({ policy, split_tokens: policy === 'split' ? split : byTokens, unsplit_tokens: byTokens });
      expect(report.routes.conflicts).toBeGreaterThan(0);
      expect(report.packed_tokens).toBe(policy === 'split' ? split : byTokens);
      const out = join(dir, `out-${policy}`);
      const pk = cli(['pack', input, '--out', out, '--route-conflict', policy, '--advantages', 'none', '--quiet']);
      expect(pk.code, pk.stderr).toBe(0);
      const manifest = JSON.parse(readFileSync(join(out, 'manifest.json'), 'utf8'));
      expect(manifest).toMatchObject({
        route_conflict: policy,
        route_split_tokens: report.routes.split_tokens,
        route_unsplit_tokens: byTokens,
      });
    }
    const bad = cli(['stats', input, '--route-conflict', 'last']);
    expect(bad.code).toBe(2);
    expect(bad.stderr).toMatch(/--route-conflict/);
  });
});
