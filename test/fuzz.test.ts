/**
 * Mutation fuzzer over `treepack pack`: valid chat-episode, pre-tokenized and slime JSONL files, each mutated with
 * fixed seeds (values swapped for hostile ones, keys dropped, arrays cut, ids repeated, bytes truncated, inserted or
 * made invalid UTF-8), then packed in-process through the CLI's own `pack` command. Every case must end in one of
 * two ways:
 * - accepted: every micro-batch the manifest names satisfies the forest invariants, has loss_mask 0/1, input_ids ≥ 0
 *   and finite float fields at trainable occurrences; the input was valid UTF-8 and repeated no episode_id on
 *   different lines;
 * - rejected: a TreepackError whose message is one line naming the input file and its line.
 * Anything else (another exception, i.e. a stack trace from the CLI, a hang) is a finding. A few rejections also
 * run through the compiled bin: one line on stderr and exit status 1.
 */
import { isUtf8 } from 'node:buffer';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it, vi } from 'vitest';
import { packCommand } from '../src/cli/pack.js';
import { TreepackError } from '../src/errors.js';
import { readMicroBatch } from '../src/io/microbatch.js';
import { OCCURRENCE_FLOAT_FIELDS } from '../src/pack/contract.js';
import { checkForest } from '../src/pack/invariants.js';
import { generateEpisodes, generateTokenSamples } from '../bench/dataset.js';
import { cli } from './helpers/cli.js';
import { rng } from './helpers/sequences.js';

// The Qwen3 tokenizer is not under test here: load it once, not once per case.
vi.mock('../src/tokenize/tokenizer.js', async (importOriginal) => {
  const real = await importOriginal<typeof import('../src/tokenize/tokenizer.js')>();
  const loaded = new Map<string | undefined, ReturnType<typeof real.loadTokenizer>>();
  const loadTokenizer: typeof real.loadTokenizer = (d) => {
    if (!loaded.has(d)) loaded.set(d, real.loadTokenizer(d));
    return loaded.get(d)!;
  };
  return { ...real, loadTokenizer };
});

const CASES = 300;
const dir = mkdtempSync(join(tmpdir(), 'treepack-fuzz-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** Valid seed files, one line per record. */
function seeds(): Record<string, string[]> {
  const chat = [...generateEpisodes({ groups: 2, episodesPerGroup: 2, seed: 3, minTurns: 2, maxTurns: 3 })].map((e) => JSON.stringify(e));
  const tokens = [...generateTokenSamples({ groups: 2, episodesPerGroup: 2, seed: 4, minTurns: 2, maxTurns: 3 })]
    .slice(0, 8)
    .map((s) => JSON.stringify(s));
  const r = rng(5);
  const slime = Array.from({ length: 6 }, (_, i) => {
    const n = 6 + Math.floor(r() * 10);
    const rl = 1 + Math.floor(r() * (n - 1));
    const toks = Array.from({ length: n }, (_, t) => (t < 3 ? t + 10 : Math.floor(r() * 50)));
    const lp = Array.from({ length: rl }, () => -Math.round(r() * 3000) / 1000);
    return JSON.stringify({
      tokens: toks,
      response_length: rl,
      loss_mask: Array(rl).fill(1),
      rollout_log_probs: lp,
      reward: Math.round(r() * 4) / 4,
      index: i,
      group_index: i >> 1,
    });
  });
  return { chat, tokens, slime };
}

const HOSTILE: unknown[] = [
  null,
  -1,
  0,
  1,
  7,
  1e39,
  -1e39,
  1e308,
  -1e308,
  2 ** 31,
  -(2 ** 31) - 1,
  1.5,
  5e-324,
  '',
  'x',
  '\u0000',
  [],
  {},
  true,
  [1e39],
  [-1],
  [[1]],
  'ep-dup',
];

type Json = null | boolean | number | string | Json[] | { [k: string]: Json };

/** Every (container, key) pair of a JSON value, depth first. */
function slots(v: Json, out: [Json[] | { [k: string]: Json }, string | number][] = []): typeof out {
  if (Array.isArray(v)) v.forEach((x, i) => (out.push([v, i]), slots(x, out)));
  else if (v !== null && typeof v === 'object')
    for (const k of Object.keys(v)) {
      out.push([v, k]);
      slots(v[k], out);
    }
  return out;
}

const pick = <T>(r: () => number, xs: readonly T[]): T => xs[Math.floor(r() * xs.length)];

/** One structural mutation of a parsed line. */
function mutateValue(v: Json, r: () => number): Json {
  const all = slots(v);
  if (all.length === 0) return pick(r, HOSTILE) as Json;
  const [c, k] = pick(r, all);
  const op = Math.floor(r() * 6);
  if (Array.isArray(c)) {
    const i = k as number;
    if (op === 0) c.splice(i, 1);
    else if (op === 1) c.splice(i, 0, c[i]);
    else if (op === 2) c.length = i;
    else c[i] = pick(r, HOSTILE) as Json;
  } else {
    const obj = c;
    if (op === 0) delete obj[k as string];
    else if (op === 1) obj[`${k}_x`] = obj[k as string];
    else if (op === 2 && typeof obj[k as string] === 'number') obj[k as string] = -(obj[k as string] as number) * 1e38;
    else obj[k as string] = pick(r, HOSTILE) as Json;
  }
  return v;
}

const INVALID_UTF8 = [Buffer.from([0xff]), Buffer.from([0xc3]), Buffer.from([0xed, 0xa0, 0x80]), Buffer.from([0xe2, 0x82])];

/** One byte-level mutation of a line. */
function mutateBytes(line: Buffer, r: () => number): Buffer {
  const at = Math.floor(r() * (line.length + 1));
  switch (Math.floor(r() * 5)) {
    case 0:
      return line.subarray(0, at);
    case 1:
      return Buffer.concat([line.subarray(0, at), pick(r, INVALID_UTF8), line.subarray(at)]);
    case 2:
      return Buffer.concat([
        line.subarray(0, at),
        Buffer.from(pick(r, ['\r', '\u0000', '\ufeff', '"', '}', ']', ',', '9e99', '\\'])),
        line.subarray(at),
      ]);
    case 3: {
      // a string made invalid UTF-8 inside: the JSON stays well-formed
      const q = line.indexOf(0x22, at);
      return q < 0 ? line : Buffer.concat([line.subarray(0, q + 1), pick(r, INVALID_UTF8), line.subarray(q + 1)]);
    }
    default:
      return Buffer.concat([line.subarray(0, at), line.subarray(Math.min(line.length, at + 1 + Math.floor(r() * 20)))]);
  }
}

/** A mutated file: 1-3 mutations of whole lines (drop, repeat, repeat an episode_id), values or bytes. */
function mutant(lines: string[], r: () => number): Buffer {
  const out: (string | Buffer)[] = lines.slice();
  const n = 1 + Math.floor(r() * 3);
  for (let m = 0; m < n; m++) {
    const i = Math.floor(r() * out.length);
    const kind = r();
    if (kind < 0.45) {
      const text = out[i].toString();
      try {
        out[i] = JSON.stringify(mutateValue(JSON.parse(text) as Json, r));
      } catch {
        out[i] = text + 'x';
      }
    } else if (kind < 0.7) out[i] = mutateBytes(Buffer.from(out[i]), r);
    else if (kind < 0.8) out.splice(i, 1);
    else if (kind < 0.9) out.splice(i, 0, out[Math.floor(r() * out.length)]);
    else {
      // another line's episode_id on this one (a distinct episode with a colliding id)
      const j = Math.floor(r() * out.length);
      try {
        const a = JSON.parse(out[i].toString());
        const b = JSON.parse(out[j].toString());
        if (b.episode_id !== undefined) a.episode_id = b.episode_id;
        if (b.episode !== undefined) a.episode = b.episode;
        out[i] = JSON.stringify(a);
      } catch {
        /* leave a line that does not parse as it is */
      }
    }
  }
  return Buffer.concat(out.flatMap((l) => [Buffer.from(l), Buffer.from('\n')]));
}

/** What an accepted input must not have been: invalid UTF-8, or one episode_id on two different episode lines. */
function inputProblems(bytes: Buffer): string[] {
  const out: string[] = [];
  const firstText = new Map<string, string>();
  bytes
    .toString('latin1')
    .split('\n')
    .forEach((_, k, all) => {
      const raw = Buffer.from(all[k], 'latin1');
      if (!isUtf8(raw)) out.push(`line ${k + 1}: invalid UTF-8 accepted`);
      try {
        const v = JSON.parse(raw.toString('utf8'));
        if (
          v &&
          typeof v === 'object' &&
          Array.isArray(v.requests) &&
          v.requests.length > 0 &&
          (typeof v.episode_id === 'string' || Number.isInteger(v.episode_id))
        ) {
          const id = String(v.episode_id);
          const prev = firstText.get(id);
          if (prev === undefined) firstText.set(id, all[k]);
          else if (prev !== all[k]) out.push(`line ${k + 1}: episode_id ${id} of a different episode accepted`);
        }
      } catch {
        /* not JSON: the reader must reject it */
      }
    });
  return out;
}

/** What an accepted run must not have written. */
function outputProblems(out: string): string[] {
  const problems: string[] = [];
  const manifest = JSON.parse(readFileSync(join(out, 'manifest.json'), 'utf8')) as { micro_batches: { file: string }[] };
  for (const entry of manifest.micro_batches) {
    const { batch } = readMicroBatch(join(out, entry.file));
    for (const v of checkForest(batch)) problems.push(`${entry.file}: ${v}`);
    batch.input_ids.forEach((x, p) => x < 0 && problems.push(`${entry.file}: input_ids[${p}] = ${x}`));
    batch.loss_mask.forEach((x, k) => x > 1 && problems.push(`${entry.file}: loss_mask[${k}] = ${x}`));
    for (const f of OCCURRENCE_FLOAT_FIELDS) {
      const a = batch[f];
      a?.forEach(
        (x, k) => batch.loss_mask[k] && !Number.isFinite(x) && problems.push(`${entry.file}: ${f}[${k}] = ${x} at a trainable occurrence`),
      );
    }
  }
  return problems;
}

interface Tally {
  cases: number;
  accepted: number;
  rejected: Record<string, number>;
  findings: string[];
  rejections: { file: string; message: string }[];
}

async function runCase(file: string, out: string, extra: string[]): Promise<{ ok: true } | { err: unknown }> {
  const quiet = console.error;
  console.error = () => undefined; // pack's warnings and progress; errors are thrown, not printed, in-process
  try {
    await packCommand([file, '--out', out, '--quiet', '--tokenizer', 'qwen3', ...extra]);
    return { ok: true };
  } catch (err) {
    return { err };
  } finally {
    console.error = quiet;
  }
}

describe('mutation fuzzer', () => {
  it(
    `${CASES} mutated chat, pre-tokenized and slime files: accepted with valid output, or rejected in one line naming the line`,
    { timeout: 300_000 },
    async () => {
      const base = seeds();
      const kinds = Object.keys(base);
      const r = rng(20261123);
      const t: Tally = { cases: 0, accepted: 0, rejected: {}, findings: [], rejections: [] };
      for (let c = 0; c < CASES; c++) {
        const kind = kinds[c % kinds.length];
        const bytes = mutant(base[kind], r);
        const file = join(dir, `case-${c}.jsonl`);
        const out = join(dir, `out-${c}`);
        writeFileSync(file, bytes);
        // Every third case also through the budgeted planner and without the merge.
        const extra = c % 3 === 1 ? ['--max-tokens', '100000', '--dp', '2'] : c % 3 === 2 ? ['--no-merge'] : [];
        const res = await runCase(file, out, extra);
        t.cases++;
        if ('ok' in res) {
          t.accepted++;
          for (const p of [...inputProblems(bytes), ...outputProblems(out)]) t.findings.push(`case ${c} (${kind}) accepted: ${p}`);
        } else if (res.err instanceof TreepackError) {
          const e = res.err;
          t.rejected[e.code] = (t.rejected[e.code] ?? 0) + 1;
          if (e.message.includes('\n')) t.findings.push(`case ${c} (${kind}): a rejection of more than one line: ${e.message}`);
          if (e.where.file !== file || e.where.line === undefined)
            t.findings.push(`case ${c} (${kind}): a rejection not naming file and line: ${e.message}`);
          else t.rejections.push({ file, message: e.message });
        } else {
          t.findings.push(`case ${c} (${kind}): crash (a stack trace from the CLI): ${(res.err as Error)?.stack ?? String(res.err)}`);
        }
        rmSync(out, { recursive: true, force: true });
      }
      const rejected = Object.values(t.rejected).reduce((a, b) => a + b, 0);
      console.log(
        `fuzz: ${t.cases} cases, ${t.accepted} accepted, ${rejected} rejected ${JSON.stringify(t.rejected)}, ${t.findings.length} findings`,
      );
      for (const f of t.findings.slice(0, 20)) console.log(`  ${f.split('\n').slice(0, 3).join(' | ')}`);
      expect(t.findings).toEqual([]);
      // Both outcomes occur: the mutations neither break every file nor leave every file valid.
      expect(t.accepted).toBeGreaterThan(CASES / 10);
      expect(rejected).toBeGreaterThan(CASES / 10);

      // Through the bin: a rejection is one line on stderr, exit status 1, no stack trace.
      for (const { file } of t.rejections.filter((_, k) => k % Math.ceil(t.rejections.length / 4) === 0)) {
        const outDir = join(dir, 'bin-out');
        mkdirSync(outDir, { recursive: true });
        const res = cli(['pack', file, '--out', join(outDir, 'x'), '--quiet', '--tokenizer', 'qwen3']);
        expect(res.code, res.stderr).toBe(1);
        expect(res.stderr.trimEnd().split('\n'), res.stderr).toHaveLength(1);
        expect(res.stderr).toMatch(new RegExp(`^treepack pack: ${file.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')}:\\d+`));
      }
    },
  );
});
