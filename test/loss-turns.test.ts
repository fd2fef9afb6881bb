/**
 * The trainer normalisations (seq_weight, loss_scale) and AgentFlow's Flow-GRPO turn aggregation on every backend,
 * against float64 references written here from the formulas, sharing no code with src/loss:
 *   Flow-GRPO  L = loss_scale · (1/G) Σᵢ wᵢ (1/Tᵢ) Σₜ (1/|aₜ|) Σⱼ∈aₜ ℓⱼ
 * computed on the UNMERGED trajectories (each turn its own list of tokens), and its analytic gradient. The packed
 * side goes through the packer (assembleMicroBatch derives turn_ids from message boundaries; packRecords merges an
 * episode's calls into one sequence), so the test covers the turns as the contract stores them.
 */
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { computeLoss, computeLossCompact, type BackendName } from '../src/backend/index.js';
import { TreepackError } from '../src/errors.js';
import { readMicroBatch, writeMicroBatch } from '../src/io/microbatch.js';
import { buildCompactPlan, resolveLossConfig, type LossConfig } from '../src/loss/index.js';
import { lossReference } from '../src/loss/reference.js';
import { assembleMicroBatch } from '../src/pack/batch.js';
import { FORMAT, type MicroBatch } from '../src/pack/contract.js';
import { packForest } from '../src/pack/forest.js';
import { checkForest } from '../src/pack/invariants.js';
import type { PackedMicroBatch } from '../src/packer/core.js';
import { packRecords, type PackInput } from '../src/packer/pack-records.js';
import type { PackerOptions } from '../src/packer/options.js';
import type { Author, Sample } from '../src/records/types.js';
import { describeBackends } from './helpers/backends.js';
import { caught } from './helpers/errors.js';
import { close } from './helpers/loss.js';
import { rng } from './helpers/sequences.js';

const TURNS = 'seq-mean-turn-mean-token-mean';
const tolerance = (b: BackendName) => (b === 'webgpu' ? 2e-5 : 1e-6);

/** One token of the unmerged view: its node in the packed forest (for the gradient) and its values. */
interface Tok {
  id: number;
  mask: number;
  lp: number;
  old: number;
  ref: number;
  adv: number;
}
/** A trajectory as its messages: context (prompt, tool output) and assistant turns, each its own token list. */
interface Message {
  author: Author;
  toks: Tok[];
}
interface Trajectory {
  messages: Message[];
  weight: number;
}

/** float32-exact value in [lo, hi) from a prefix key: equal prefixes (shared nodes) get equal logprobs. */
function hashed(key: number, salt: number, lo: number, hi: number): number {
  let h = Math.imul(key ^ salt, 0x9e3779b1) >>> 0;
  h ^= h >>> 15;
  h = Math.imul(h, 0x85ebca6b) >>> 0;
  h ^= h >>> 13;
  return Math.fround(lo + (h / 4294967296) * (hi - lo));
}

/**
 * Random trajectories: groups share a prompt; a trajectory may copy an earlier one's first turn exactly (the turn
 * is then one run of shared nodes in the forest); turns have masked holes, some are wholly masked, and tool
 * messages sit between them. lp, old and ref are functions of the token's prefix when `sharedOld` (compact mode).
 */
function trajectories(seed: number, opts: { count: number; sharedOld?: boolean; maxTurns?: number }): Trajectory[] {
  const r = rng(seed);
  const out: Trajectory[] = [];
  const firstTurns: number[][] = [];
  for (let i = 0; i < opts.count; i++) {
    const ids: { author: Author; ids: number[]; holes: number }[] = [{ author: 'user', ids: [1, 2, 3 + (i % 2)], holes: 0 }];
    const turns = 1 + Math.floor(r() * (opts.maxTurns ?? 4));
    for (let k = 0; k < turns; k++) {
      // Trajectory i − 2 has the same prompt: copying its first turn shares that turn's nodes.
      const copy = k === 0 && i >= 2 && r() < 0.5;
      const t = copy ? firstTurns[i - 2].slice() : Array.from({ length: 1 + Math.floor(r() * 5) }, () => 10 + Math.floor(r() * 6));
      if (k === 0) firstTurns.push(t);
      ids.push({ author: 'llm', ids: t, holes: r() < 0.15 ? 1 : 0.25 });
      if (k + 1 < turns)
        ids.push({ author: 'tool', ids: Array.from({ length: 1 + Math.floor(r() * 3) }, () => 20 + Math.floor(r() * 4)), holes: 0 });
    }
    const A = Math.fround(r() * 4 - 2);
    const messages = ids.map((m) => ({
      author: m.author,
      toks: m.ids.map((id) => ({
        id,
        mask: m.author === 'llm' && r() >= m.holes ? 1 : 0,
        lp: 0,
        old: (r() - 0.5) * 1.2,
        ref: r() - 0.5,
        adv: r() < 0.1 ? 0 : A,
      })),
    }));
    out.push(rekey({ messages, weight: [1, 0, 0.5, 2, 1.25][i % 5] }, opts.sharedOld ?? false));
  }
  return out;
}

/** Chained hash of token ids: equal prefixes, equal keys. */
function keyOf(prefix: ArrayLike<number>): number {
  return Array.from(prefix).reduce((h, id) => (Math.imul(h, 1000003) ^ (id + 1)) >>> 0, 17);
}

/**
 * lp of each token from its prefix (a node's logprob is one value, whichever sequence reaches it); old and ref too
 * when `shared`, else lp plus the offsets old and ref held.
 */
function rekey(t: Trajectory, shared: boolean): Trajectory {
  let key = 17;
  for (const m of t.messages) {
    for (const x of m.toks) {
      key = (Math.imul(key, 1000003) ^ (x.id + 1)) >>> 0;
      const lp = hashed(key, 1, -3, 0);
      x.old = shared ? hashed(key, 2, -3, 0) : Math.fround(lp + (x.old - x.lp));
      x.ref = shared ? hashed(key, 3, -3, 0) : Math.fround(lp + (x.ref - x.lp));
      x.lp = lp;
    }
  }
  return t;
}

/** The packed micro-batch of trajectories, built as the packer builds one: samples with message boundaries. */
function packed(ts: Trajectory[]): { batch: MicroBatch & { seq_weight: Float32Array }; lp: Float32Array } {
  const samples: Sample[] = ts.map((t, i) => {
    const toks = t.messages.flatMap((m) => m.toks);
    const starts: number[] = [];
    let at = 0;
    for (const m of t.messages) {
      starts.push(at);
      at += m.toks.length;
    }
    return {
      kind: 'sample',
      id: `t${i}`,
      group: 'g',
      episode: `t${i}`,
      tokens: Int32Array.from(toks, (x) => x.id),
      loss_mask: Uint8Array.from(toks, (x) => x.mask),
      advantages: Float32Array.from(toks, (x) => x.adv),
      old_logprobs: Float32Array.from(toks, (x) => x.old),
      ref_logprobs: Float32Array.from(toks, (x) => x.ref),
      message_offsets: Int32Array.from(starts),
      message_authors: t.messages.map((m) => m.author),
      source: { file: 't', line: i + 1 },
    };
  });
  const batch = assembleMicroBatch(samples, { tokenizer: 't', packForest, turnIds: true });
  expect(checkForest(batch)).toEqual([]);
  const lp = new Float32Array(batch.input_ids.length);
  ts.forEach((t, i) => t.messages.flatMap((m) => m.toks).forEach((x, k) => (lp[batch.seq_positions[batch.seq_offsets[i] + k]] = x.lp)));
  return { batch: { ...batch, seq_weight: Float32Array.from(ts, (t) => t.weight) }, lp };
}

interface Expected {
  loss: number;
  pg_loss: number;
  kl_loss: number;
  /** dloss/dlp per unmerged token, in trajectory and message order. */
  grad: number[];
}

const cl = (x: number, lo: number, hi: number) => Math.min(Math.max(x, lo), hi);

/** verl's clipped surrogate with dual clip, and k2 KL: [pg, dpg/dlp, kl, dkl/dlp] of one token. */
function token(x: Tok, c: LossConfig): [number, number, number, number] {
  const lr = x.lp - x.old;
  const r = Math.exp(cl(lr, -c.log_ratio_clamp, c.log_ratio_clamp));
  const dr = Math.abs(lr) <= c.log_ratio_clamp ? r : 0;
  const l1 = -x.adv * r;
  const l2 = -x.adv * cl(r, 1 - c.clip_low, 1 + c.clip_high);
  let pg = l1 >= l2 ? l1 : l2;
  let d = l1 >= l2 ? -x.adv * dr : 0;
  if (x.adv < 0 && c.dual_clip > 0 && pg > -x.adv * c.dual_clip) {
    pg = -x.adv * c.dual_clip;
    d = 0;
  }
  const diff = x.lp - x.ref;
  return [pg, d, 0.5 * diff * diff, diff];
}

/**
 * The Flow-GRPO loss on unmerged trajectories: per turn (an assistant message, its own token list) the mean over its
 * trainable tokens; per trajectory the mean over its turns that have any; then Σ over trajectories with any turn,
 * each times its weight, over G (or global_sequences), times loss_scale.
 */
function flowGrpo(ts: Trajectory[], c: LossConfig): Expected {
  const grad: number[] = [];
  const live = ts.filter((t) => t.messages.some((m) => m.author === 'llm' && m.toks.some((x) => x.mask)));
  const G = c.global_sequences || live.length;
  let pg = 0;
  let kl = 0;
  for (const t of ts) {
    const turns = t.messages.filter((m) => m.author === 'llm' && m.toks.some((x) => x.mask));
    for (const m of t.messages) {
      const n = m.toks.filter((x) => x.mask).length;
      for (const x of m.toks) {
        if (!x.mask || m.author !== 'llm') {
          grad.push(0);
          continue;
        }
        const w = (c.loss_scale * t.weight) / (G * turns.length * n);
        const [p, dp, k, dk] = token(x, c);
        pg += w * p;
        kl += w * k;
        grad.push(w * (dp + c.kl_coef * dk));
      }
    }
  }
  return { loss: pg + c.kl_coef * kl, pg_loss: pg, kl_loss: kl, grad };
}

/** Per-token expected gradients summed onto the nodes their occurrences map to. */
function nodeGrad(batch: MicroBatch, perToken: number[]): Float64Array {
  const g = new Float64Array(batch.input_ids.length);
  perToken.forEach((v, j) => (g[batch.seq_positions[j]] += v));
  return g;
}

function expectFlow(
  got: { loss: number; grad: Float32Array; metrics: { pg_loss: number; kl_loss: number } },
  want: Expected,
  batch: MicroBatch,
  tol: number,
  what: string,
) {
  close(got.loss, want.loss, tol, `${what} loss`);
  close(got.metrics.pg_loss, want.pg_loss, tol, `${what} pg_loss`);
  close(got.metrics.kl_loss, want.kl_loss, tol, `${what} kl_loss`);
  nodeGrad(batch, want.grad).forEach((g, p) => close(got.grad[p], g, tol, `${what} grad[${p}]`));
}

const BASE: Partial<LossConfig> = { aggregation: TURNS, clip_low: 0.2, clip_high: 0.28, dual_clip: 3, kl: 'k2', kl_coef: 0.1 };

describe('Flow-GRPO reference and the packer', () => {
  it('the packer gives each assistant message its turn id, never decreasing, and a tool message the id of the turn before', () => {
    const ts = trajectories(1, { count: 6 });
    const { batch } = packed(ts);
    ts.forEach((t, i) => {
      let want = -1;
      const ids = t.messages.flatMap((m) => {
        if (m.author === 'llm') want++;
        return m.toks.map(() => want);
      });
      expect(Array.from(batch.turn_ids!.subarray(batch.seq_offsets[i], batch.seq_offsets[i + 1]))).toEqual(ids);
    });
  });

  it('negative control: on multi-turn trajectories the turn mean differs from seq-mean-token-mean', () => {
    const ts = trajectories(2, { count: 8 });
    const { batch, lp } = packed(ts);
    const flow = lossReference(batch, lp, resolveLossConfig(BASE));
    const seq = lossReference(batch, lp, resolveLossConfig({ ...BASE, aggregation: 'seq-mean-token-mean' }));
    expectFlow(flow, flowGrpo(ts, resolveLossConfig(BASE)), batch, 1e-6, 'js');
    expect(Math.abs(flow.loss - seq.loss)).toBeGreaterThan(1e-3);
  });

  it('js gradient equals central finite differences of the js loss (float64)', () => {
    const ts = trajectories(3, { count: 5 });
    const { batch, lp } = packed(ts);
    const cfg = resolveLossConfig({ ...BASE, loss_scale: 3 });
    const lp64 = Float64Array.from(lp) as unknown as Float32Array;
    const g = lossReference(batch, lp64, cfg).grad;
    for (let p = 0; p < lp.length; p++) {
      const x = lp64[p];
      lp64[p] = x + 1e-6;
      const up = lossReference(batch, lp64, cfg).loss;
      lp64[p] = x - 1e-6;
      const down = lossReference(batch, lp64, cfg).loss;
      lp64[p] = x;
      close(g[p], (up - down) / 2e-6, 2e-5, `d/dlp[${p}]`);
    }
  });

  it('refuses what would aggregate wrong: no turn_ids, turn ids that decrease, a negative or non-finite seq_weight', async () => {
    const { batch, lp } = packed(trajectories(4, { count: 3 }));
    const field = async (b: object, config: Partial<LossConfig> = BASE) =>
      ((await computeLoss(b as MicroBatch, lp, config, { backend: 'js' }).catch((e: unknown) => e)) as TreepackError).where?.field;
    expect(await field({ ...batch, turn_ids: undefined })).toBe('turn_ids');
    const down = batch.turn_ids!.slice();
    down[batch.seq_offsets[1] - 1] = -2;
    expect(await field({ ...batch, turn_ids: down })).toBe('turn_ids');
    expect(await field({ ...batch, turn_ids: down }, { ...BASE, aggregation: 'token-mean' })).toBeUndefined(); // read only by the turn mode
    expect(await field({ ...batch, seq_weight: Float32Array.from([1, -1, 1]) })).toBe('seq_weight');
    expect(await field({ ...batch, seq_weight: Float32Array.from([1, NaN, 1]) })).toBe('seq_weight');
    expect(await field({ ...batch, seq_weight: Float32Array.from([1, 1]) })).toBe('seq_weight');
    expect((caught(() => resolveLossConfig({ loss_scale: -1 })) as TreepackError).where.field).toBe('loss_scale');
  });

  it('turn_ids survive a micro-batch file, and the forest check refuses decreasing ones', () => {
    const { batch } = packed(trajectories(5, { count: 4 }));
    const path = join(mkdtempSync(join(tmpdir(), 'treepack-turns-')), 'mb.safetensors');
    writeMicroBatch(path, batch);
    const back = readMicroBatch(path).batch;
    expect(Array.from(back.turn_ids!)).toEqual(Array.from(batch.turn_ids!));
    const down = { ...batch, turn_ids: batch.turn_ids!.map((t, j) => (j === batch.seq_offsets[1] - 1 ? -5 : t)) };
    expect(checkForest(down).join('\n')).toMatch(/turn_ids\[\d+\] = -5/);
  });
});

describe('an episode through the packer', () => {
  /** Three calls of one episode, each the previous context plus a tool result and a new answer, as sample records. */
  function episode(e: number, answers: number[][]) {
    const prompt = [1, 2, 3 + e];
    const records = [];
    let tokens = prompt.slice();
    let starts = [0];
    let authors: Author[] = ['user'];
    let mask = prompt.map(() => 0);
    for (let k = 0; k < answers.length; k++) {
      if (k > 0) {
        starts = [...starts, tokens.length];
        authors = [...authors, 'tool'];
        tokens = [...tokens, 30 + k, 31];
        mask = [...mask, 0, 0];
      }
      const ctxMask = mask.map(() => 0); // earlier answers are context in a later call
      const ans = answers[k];
      records.push({
        id: `e${e}/${k}`,
        group: 'g',
        episode: `e${e}`,
        advantage: e === 0 ? 1.5 : -0.75,
        tokens: [...tokens, ...ans],
        loss_mask: [...ctxMask, ...ans.map((_, t) => (t === 1 && ans.length > 2 ? 0 : 1))],
        message_offsets: [...starts, tokens.length],
        message_authors: [...authors.map((a) => (a === 'llm' ? 'env' : a)), 'llm'],
      });
      starts = [...starts, tokens.length];
      authors = [...authors, 'llm'];
      tokens = [...tokens, ...ans];
      mask = [...mask, ...ans.map(() => 0)];
    }
    return records;
  }

  /** The one micro-batch of a packer run. */
  async function packOne(input: PackInput, options: PackerOptions = {}): Promise<MicroBatch> {
    const out: PackedMicroBatch[] = [];
    for await (const mb of packRecords(input, options)) out.push(mb);
    expect(out.length).toBe(1);
    return out[0].batch;
  }

  /** Node and old logprobs as functions of the prefix: the same in a merged sequence and in each call. */
  function withLogprobs(batch: MicroBatch): { b: MicroBatch; lp: Float32Array } {
    const lp = new Float32Array(batch.input_ids.length);
    const old = new Float32Array(batch.seq_positions.length);
    for (let i = 0; i + 1 < batch.seq_offsets.length; i++) {
      for (let j = batch.seq_offsets[i]; j < batch.seq_offsets[i + 1]; j++) {
        const key = keyOf(batch.seq_positions.subarray(batch.seq_offsets[i], j + 1).map((p) => batch.input_ids[p]));
        lp[batch.seq_positions[j]] = hashed(key, 1, -3, 0);
        old[j] = hashed(key, 2, -3, 0);
      }
    }
    return { b: { ...batch, old_logprobs: old }, lp };
  }

  it('merges each episode into one sequence whose turns give the loss of the unmerged calls', async () => {
    const records = [
      ...episode(0, [[40, 41, 42], [43], [44, 45, 46, 47]]),
      ...episode(1, [
        [40, 41, 42],
        [50, 51],
      ]),
    ];
    expect((await packOne(records)).turn_ids).toBeUndefined(); // stored only when asked for
    const merged = await packOne(records, { turnIds: true });
    expect(merged.meta.num_sequences).toBe(2); // the timeline merge made one sequence per episode
    const { b, lp } = withLogprobs(merged);
    // The unmerged view: each call's answer is one turn of its episode's trajectory, read from the records alone.
    const ts: Trajectory[] = ['e0', 'e1'].map((e) => ({
      weight: 1,
      messages: records
        .filter((r) => r.episode === e)
        .map((r) => {
          const from = r.message_offsets[r.message_offsets.length - 1];
          return {
            author: 'llm',
            toks: r.tokens.slice(from).map((id, t) => {
              const key = keyOf(r.tokens.slice(0, from + t + 1));
              return { id, mask: r.loss_mask[from + t], lp: hashed(key, 1, -3, 0), old: hashed(key, 2, -3, 0), ref: 0, adv: r.advantage };
            }),
          };
        }),
    }));
    const cfg = resolveLossConfig({ aggregation: TURNS, clip_low: 0.2, clip_high: 0.28 });
    const want = flowGrpo(ts, cfg);
    for (const backend of ['js', 'cpu'] as const) {
      const got = await computeLoss(b, lp, cfg, { backend }).catch((e: unknown) => e);
      if (backend === 'cpu' && got instanceof TreepackError && got.code === 'E_BACKEND') continue;
      close((got as { loss: number }).loss, want.loss, 1e-6, `${backend} loss`);
    }
    // Negative control: packed without the merge, each call is its own trajectory, and the loss is another.
    const apart = withLogprobs(await packOne(records, { merge: false, turnIds: true }));
    expect(apart.b.meta.num_sequences).toBe(5);
    const other = await computeLoss(apart.b, apart.lp, cfg, { backend: 'js' });
    expect(Math.abs(other.loss - want.loss)).toBeGreaterThan(1e-3);
  });
});

await describeBackends('loss', (backend) => {
  const tol = tolerance(backend);
  const run = (b: MicroBatch, lp: Float32Array, config: Partial<LossConfig>) => computeLoss(b, lp, config, { backend });

  it('Flow-GRPO equals the float64 formula on the unmerged turns, with its gradient, for many seeds', async () => {
    for (const seed of [11, 12, 13, 14]) {
      const ts = trajectories(seed, { count: 3 + (seed % 5) * 3, maxTurns: seed % 2 ? 6 : 3 });
      const { batch, lp } = packed(ts);
      for (const extra of [{}, { loss_scale: 8 }, { global_sequences: 40, kl_coef: 0.5 }]) {
        const cfg = resolveLossConfig({ ...BASE, ...extra });
        expectFlow(await run(batch, lp, cfg), flowGrpo(ts, cfg), batch, tol, `seed ${seed} ${JSON.stringify(extra)}`);
      }
    }
  });

  it('one turn per trajectory: Flow-GRPO is seq-mean-token-mean', async () => {
    const ts = trajectories(21, { count: 9, maxTurns: 1 });
    const { batch, lp } = packed(ts);
    const flow = await run(batch, lp, BASE);
    const seq = await run(batch, lp, { ...BASE, aggregation: 'seq-mean-token-mean' });
    expectFlow(flow, flowGrpo(ts, resolveLossConfig(BASE)), batch, tol, 'one turn');
    close(flow.loss, seq.loss, tol, 'flow vs seq-mean-token-mean');
  });

  it('a turn shared by two sequences through the prefix tree counts once in each', async () => {
    const ts = trajectories(31, { count: 2, maxTurns: 3 });
    ts[1].messages = [ts[0].messages[0], ts[0].messages[1], ...trajectories(32, { count: 1, maxTurns: 3 })[0].messages.slice(2)];
    ts[1].messages[1] = { author: 'llm', toks: ts[0].messages[1].toks.map((x) => ({ ...x, adv: -x.adv })) }; // same nodes, its own advantages
    ts[1].messages = ts[1].messages.map((m) => ({ ...m, toks: m.toks.map((x) => ({ ...x })) }));
    rekey(ts[1], false);
    const { batch, lp } = packed(ts);
    const shared = batch.seq_positions[batch.seq_offsets[1] + ts[0].messages[0].toks.length];
    expect(shared).toBe(batch.seq_positions[ts[0].messages[0].toks.length]); // the first turn's nodes are shared
    expectFlow(await run(batch, lp, BASE), flowGrpo(ts, resolveLossConfig(BASE)), batch, tol, 'shared turn');
  });

  it('an empty batch and sequences with no trainable token give 0 and no gradient', async () => {
    const empty: MicroBatch = {
      ...packForest({ tokens: new Int32Array(0), offsets: new Int32Array(1) }),
      loss_mask: new Uint8Array(0),
      advantages: new Float32Array(0),
      old_logprobs: new Float32Array(0),
      ref_logprobs: new Float32Array(0),
      meta: { format: FORMAT, num_sequences: 0, num_tokens_naive: 0, num_tokens_packed: 0, tokenizer: 't', sequence_ids: [] },
    };
    for (const aggregation of [TURNS, 'token-mean', 'seq-mean-token-mean'] as const) {
      const r = await run(empty, new Float32Array(0), { ...BASE, aggregation, loss_scale: 4 });
      expect([r.loss, r.metrics.trainable_tokens, r.grad.length]).toEqual([0, 0, 0]);
    }
    const ts = trajectories(41, { count: 6 });
    for (const i of [0, 3]) for (const m of ts[i].messages) for (const x of m.toks) x.mask = 0;
    const { batch, lp } = packed(ts);
    expectFlow(await run(batch, lp, BASE), flowGrpo(ts, resolveLossConfig(BASE)), batch, tol, 'untrainable sequences');
    const dead = packed(
      ts.map((t) => ({ ...t, messages: t.messages.map((m) => ({ ...m, toks: m.toks.map((x) => ({ ...x, mask: 0 })) })) })),
    );
    const r = await run(dead.batch, dead.lp, BASE);
    expect(r.loss).toBe(0);
    expect(r.grad.every((g) => g === 0)).toBe(true);
  });

  it('seq_weight and loss_scale scale each aggregation as docs/concepts/loss.md says (zeros keep their counts)', async () => {
    const ts = trajectories(51, { count: 10 });
    const { batch, lp } = packed(ts);
    const unweighted = { ...batch, seq_weight: undefined };
    for (const aggregation of ['token-mean', 'seq-mean-token-sum', 'seq-mean-token-mean', 'seq-mean-token-sum-norm', TURNS] as const) {
      const config = { ...BASE, aggregation, norm_constant: 13 };
      const weighted = await run(batch, lp, { ...config, loss_scale: 2.5 });
      // Σᵢ wᵢ·(sequence i's part): sequence i alone, everything else masked, keeps the batch's counts through the
      // global normalisers, so the parts add up to the weighted loss.
      const T = batch.loss_mask.reduce((a, m) => a + m, 0);
      const G = ts.filter((t) => t.messages.some((m) => m.toks.some((x) => x.mask))).length;
      let sum = 0;
      const grad = new Float64Array(lp.length);
      for (let i = 0; i < ts.length; i++) {
        const mask = batch.loss_mask.map((m, j) => (j >= batch.seq_offsets[i] && j < batch.seq_offsets[i + 1] ? m : 0));
        const part = await run({ ...unweighted, loss_mask: mask }, lp, { ...config, global_tokens: T, global_sequences: G });
        sum += ts[i].weight * part.loss;
        part.grad.forEach((g, p) => (grad[p] += 2.5 * ts[i].weight * g));
      }
      close(weighted.loss, 2.5 * sum, tol, `${aggregation} weighted`);
      grad.forEach((g, p) => close(weighted.grad[p], g, tol, `${aggregation} grad[${p}]`));
      expect(weighted.metrics.trainable_tokens).toBe(T); // a zero weight keeps its tokens in the metrics
    }
    if (backend === 'js') return;
    const js = await computeLoss(batch, lp, { ...BASE, loss_scale: 0.5 }, { backend: 'js' });
    close((await run(batch, lp, { ...BASE, loss_scale: 0.5 })).loss, js.loss, tol, 'equals js');
  });
});

await describeBackends('lossCompact', (backend) => {
  it('the compact plan carries the turn weights, seq_weight and loss_scale', async () => {
    for (const seed of [61, 62]) {
      const ts = trajectories(seed, { count: 8, sharedOld: true });
      const { batch, lp } = packed(ts);
      for (const extra of [{}, { loss_scale: 3 }, { aggregation: 'seq-mean-token-mean' as const, loss_scale: 0.5 }]) {
        const cfg = resolveLossConfig({ ...BASE, ...extra });
        const got = await computeLossCompact(buildCompactPlan(batch, cfg), lp, cfg, { backend });
        const want = lossReference(batch, lp, cfg);
        close(got.loss, want.loss, tolerance(backend), `seed ${seed} ${JSON.stringify(extra)} loss`);
        want.grad.forEach((g, p) => close(got.grad[p], g, tolerance(backend), `grad[${p}]`));
        if (cfg.aggregation === TURNS) expectFlow(got, flowGrpo(ts, cfg), batch, tolerance(backend), `seed ${seed} vs formula`);
      }
    }
  });
});
