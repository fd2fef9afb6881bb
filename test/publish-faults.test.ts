/**
 * Fault injection on `treepack pack --out` (issue 12): kill -9 at random points of staging and publish, two
 * writers at once, and what the next run does with the leftovers. Every trial is judged by what a reader gets:
 * manifest.json and the files it names must equal one complete run byte for byte (the old or the new one).
 *
 * Bounded: 38 trials on small inputs. TREEPACK_FAULT_SCALE=k runs k times as many; TREEPACK_FAULT_REPORT=FILE
 * writes the counts as JSON; TREEPACK_FAULT_BIN=path/to/main.js judges another build (e.g. an older one) — the
 * assertions then say what that build gets wrong.
 */
import { mkdirSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { generateTokenSamples } from '../bench/dataset.js';
import { rng } from './helpers/sequences.js';
import {
  judge,
  reference,
  restore,
  stackTrace,
  startPack,
  watchOut,
  type Normalize,
  type Reference,
  type RunResult,
} from './helpers/faults.js';

const SCALE = Math.max(1, Number(process.env.TREEPACK_FAULT_SCALE ?? 1));
const TRIALS = { kill: 20 * SCALE, killFresh: 6 * SCALE, pause: 6 * SCALE, race: 6 * SCALE };
/** One micro-batch per group: tens of files, so a publish that moves files one by one has a window to hit. */
const PACK_ARGS = ['--max-naive-tokens', '1'];

const dir = mkdtempSync(join(tmpdir(), 'treepack-faults-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

function input(name: string, groups: number, seed: number): string {
  const file = join(dir, `${name}.jsonl`);
  const samples = generateTokenSamples({ groups, seed, episodesPerGroup: 2, minTurns: 1, maxTurns: 2 });
  writeFileSync(file, [...samples].map((s) => JSON.stringify(s)).join('\n') + '\n');
  return file;
}

/** Generation numbers and directories depend on how many runs came before; content must not. */
const normGen: Normalize = (s) => s.replace(/gen-\d+/g, 'gen-N').replace(/"generation": \d+/g, '"generation": N');

const counts = {
  killPoints: 0,
  killsBeforeExit: 0,
  killOutcomes: {} as Record<string, number>,
  broken: [] as string[],
  leftoversAfterKill: 0,
  leftoverBytesMax: 0,
  recoveryFailures: [] as string[],
  concurrentTrials: 0,
  overlapping: 0,
  concurrentOutcomes: {} as Record<string, number>,
  bothExitedZero: 0,
  stackTraces: [] as string[],
};
const bump = (m: Record<string, number>, k: string) => (m[k] = (m[k] ?? 0) + 1);

let A: string, B: string, C: string;
let refA: Reference, refB: Reference, refC: Reference, refB0: Reference, refC0: Reference;
/** Duration and number of file-system events in --out (or its parent) of an uninterrupted run. */
let profileOver: { ms: number; events: number };
let profileFresh: { ms: number; events: number };

async function profiled(input: string, out: string): Promise<{ ms: number; events: number }> {
  let events = 0;
  const stop = watchOut(out, (n) => (events = n));
  const r = await startPack(input, out, PACK_ARGS).done;
  await new Promise((res) => setTimeout(res, 50)); // late watch events
  stop();
  if (r.code !== 0) throw new Error(`reference run failed: ${r.stderr}`);
  return { ms: r.ms, events };
}

beforeAll(async () => {
  A = input('a', 24, 1);
  B = input('b', 18, 2);
  C = input('c', 21, 3);
  await profiled(A, join(dir, 'ref-a'));
  refA = reference('A', join(dir, 'ref-a'));
  restore(join(dir, 'ref-b'), refA.snap);
  profileOver = await profiled(B, join(dir, 'ref-b'));
  refB = reference('B', join(dir, 'ref-b'));
  restore(join(dir, 'ref-c'), refA.snap);
  await profiled(C, join(dir, 'ref-c'));
  refC = reference('C', join(dir, 'ref-c'));
  profileFresh = await profiled(B, join(dir, 'ref-b0'));
  refB0 = reference('B', join(dir, 'ref-b0'));
  await profiled(C, join(dir, 'ref-c0'));
  refC0 = reference('C', join(dir, 'ref-c0'));
}, 120_000);

const report = () => JSON.stringify({ scale: SCALE, profileOver, profileFresh, ...counts }, null, 1);
/** After every trial, so a long run (a large TREEPACK_FAULT_SCALE) can be stopped with its counts so far. */
function flush() {
  if (process.env.TREEPACK_FAULT_REPORT) writeFileSync(process.env.TREEPACK_FAULT_REPORT, report() + '\n');
}
afterAll(() => console.log(`fault injection: ${report()}`));

/** Kills a run of `input` into `out` at a random time of its run, or at a random file-system event in --out. */
async function killTrial(seed: number, input: string, out: string, profile: { ms: number; events: number }): Promise<RunResult> {
  const r = rng(seed);
  const byEvent = seed % 2 === 1;
  const at = byEvent ? 1 + Math.floor(r() * profile.events) : r() * profile.ms * 1.05;
  let run: ReturnType<typeof startPack> | undefined;
  const kill = () => run?.child.kill('SIGKILL');
  const stop = byEvent ? watchOut(out, (n) => n === at && kill()) : () => {};
  run = startPack(input, out, PACK_ARGS);
  const timer = byEvent ? undefined : setTimeout(kill, at);
  const res = await run.done;
  clearTimeout(timer);
  stop();
  counts.killPoints++;
  if (res.signal === 'SIGKILL') counts.killsBeforeExit++;
  return res;
}

/** The next complete run into the same --out must succeed, give a whole result and clear every leftover. */
async function recover(trial: string, input: string, out: string, want: Reference, also: Reference[]) {
  const res = await startPack(input, out, PACK_ARGS).done;
  const v = judge(out, [want, ...also], normGen);
  const parentLeft = readdirSync(join(out, '..')).filter((f) => f !== 'out');
  if (res.code !== 0 || v.outcome !== want.name || v.hidden.length || parentLeft.length) {
    counts.recoveryFailures.push(
      `${trial}: exit ${res.code} ${res.stderr.trim()} outcome ${v.outcome} ${v.problems.join('; ')} hidden ${v.hidden.length} parent ${parentLeft.join(',')}`,
    );
  }
  if (stackTrace(res.stderr)) counts.stackTraces.push(`${trial}: ${res.stderr}`);
}

describe('kill -9 during staging and publish', () => {
  it('over an earlier run: --out holds the old run or the new one, whole', { timeout: 600_000 }, async () => {
    for (let t = 0; t < TRIALS.kill; t++) {
      const out = join(dir, `kill-${t}`, 'out');
      restore(out, refA.snap);
      const res = await killTrial(1000 + t, B, out, profileOver);
      const v = judge(out, [refA, refB]);
      bump(counts.killOutcomes, v.outcome);
      if (v.outcome === 'broken') counts.broken.push(`kill-${t} (${res.signal ?? res.code}): ${v.problems.slice(0, 3).join('; ')}`);
      if (v.hidden.length) counts.leftoversAfterKill++;
      counts.leftoverBytesMax = Math.max(counts.leftoverBytesMax, v.hiddenBytes);
      if (stackTrace(res.stderr)) counts.stackTraces.push(`kill-${t}: ${res.stderr}`);
      await recover(`kill-${t}`, B, out, refB, [refA]);
      rmSync(join(dir, `kill-${t}`), { recursive: true, force: true });
      flush();
    }
    expect(counts.broken).toEqual([]);
    expect(counts.recoveryFailures).toEqual([]);
  });

  it('into a new --out: it does not exist afterwards, or holds the whole run', { timeout: 600_000 }, async () => {
    const before = counts.broken.length;
    for (let t = 0; t < TRIALS.killFresh; t++) {
      const out = join(dir, `fresh-${t}`, 'out');
      mkdirSync(join(dir, `fresh-${t}`));
      const res = await killTrial(2000 + t, B, out, profileFresh);
      const v = judge(out, [refB0]);
      bump(counts.killOutcomes, `fresh:${v.outcome}`);
      if (v.outcome === 'broken') counts.broken.push(`fresh-${t} (${res.signal ?? res.code}): ${v.problems.slice(0, 3).join('; ')}`);
      if (v.hidden.length) counts.leftoversAfterKill++;
      await recover(`fresh-${t}`, B, out, refB0, []);
      rmSync(join(dir, `fresh-${t}`), { recursive: true, force: true });
      flush();
    }
    expect(counts.broken.slice(before)).toEqual([]);
    expect(counts.recoveryFailures).toEqual([]);
  });
});

/** Whatever the interleaving: a whole run in --out, only from a writer that exited 0; failures are one line. */
function judgeConcurrent(trial: string, out: string, refs: Reference[], w1: RunResult, w2: RunResult, names: [string, string]) {
  counts.concurrentTrials++;
  const v = judge(out, refs, normGen);
  bump(counts.concurrentOutcomes, `${v.outcome} (exit ${w1.code ?? w1.signal}/${w2.code ?? w2.signal})`);
  if (w1.code === 0 && w2.code === 0) counts.bothExitedZero++;
  const exited = { [names[0]]: w1.code, [names[1]]: w2.code };
  if (v.outcome === 'broken') counts.broken.push(`${trial}: ${v.problems.slice(0, 3).join('; ')}`);
  else if (v.outcome in exited && exited[v.outcome] !== 0) counts.broken.push(`${trial}: --out holds run ${v.outcome}, which failed`);
  for (const [w, r] of [
    [names[0], w1],
    [names[1], w2],
  ] as const) {
    if (r.code !== 0 && (stackTrace(r.stderr) || !/^treepack pack: /.test(r.stderr))) counts.stackTraces.push(`${trial} ${w}: ${r.stderr}`);
  }
}

describe('two writers into one --out', () => {
  it('one paused at a random point of its run while the other runs', { timeout: 600_000 }, async () => {
    const before = counts.broken.length;
    for (let t = 0; t < TRIALS.pause; t++) {
      const out = join(dir, `pause-${t}`, 'out');
      restore(out, refA.snap);
      const r = rng(3000 + t);
      const byEvent = t % 2 === 1;
      const at = byEvent ? 1 + Math.floor(r() * profileOver.events) : r() * profileOver.ms;
      const w1 = startPack(B, out, PACK_ARGS);
      let paused = false;
      const pause = () => (paused = w1.child.kill('SIGSTOP'));
      const paused$ = new Promise<void>((res) => {
        const stop = byEvent ? watchOut(out, (n) => n === at && (pause(), res())) : () => {};
        const timer = byEvent ? undefined : setTimeout(() => (pause(), res()), at);
        void w1.done.then(() => (clearTimeout(timer), stop(), res()));
      });
      await paused$;
      const w2 = await startPack(C, out, PACK_ARGS).done;
      w1.child.kill('SIGCONT');
      const r1 = await w1.done;
      if (paused && r1.signal === null) counts.overlapping++;
      judgeConcurrent(`pause-${t}`, out, [refA, refB, refC], r1, w2, ['B', 'C']);
      rmSync(join(dir, `pause-${t}`), { recursive: true, force: true });
      flush();
    }
    expect(counts.broken.slice(before)).toEqual([]);
    expect(counts.stackTraces).toEqual([]);
  });

  it('started together or a random moment apart, into an earlier run or a new --out', { timeout: 600_000 }, async () => {
    const before = counts.broken.length;
    for (let t = 0; t < TRIALS.race; t++) {
      const fresh = t % 2 === 1;
      const out = join(dir, `race-${t}`, 'out');
      mkdirSync(join(dir, `race-${t}`));
      if (!fresh) restore(out, refA.snap);
      const delay = t % 4 < 2 ? 0 : rng(4000 + t)() * profileOver.ms * 0.5;
      const w1 = startPack(B, out, PACK_ARGS);
      await new Promise((res) => setTimeout(res, delay));
      const w2 = startPack(C, out, PACK_ARGS);
      const [r1, r2] = await Promise.all([w1.done, w2.done]);
      counts.overlapping++;
      judgeConcurrent(`race-${t}`, out, fresh ? [refB0, refC0] : [refA, refB, refC], r1, r2, ['B', 'C']);
      rmSync(join(dir, `race-${t}`), { recursive: true, force: true });
      flush();
    }
    expect(counts.broken.slice(before)).toEqual([]);
    expect(counts.stackTraces).toEqual([]);
  });
});
