/**
 * The bench's tau-bench input for the training step (`--data FILE`): a missing or malformed file is a TreepackError
 * naming the file (and the line), which the step section reports as that workload FAILED while the generated
 * workloads still run; a good file keeps only the first tasks whose episodes' rewards differ.
 */
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { TreepackError } from '../src/index.js';
import { generateJsonlLines, type EpisodeJson } from '../bench/dataset.js';
import { GENERATED, mixedRewardTasks, withMixedRewards } from '../bench/step.js';

const dir = mkdtempSync(join(tmpdir(), 'treepack-bench-data-'));
const out = join(dir, 'out.jsonl');
const episode = (task: string, reward: number) => JSON.stringify({ task_id: task, meta: { reward }, requests: [] });

function thrown(f: () => unknown): TreepackError {
  try {
    f();
  } catch (e) {
    expect(e).toBeInstanceOf(TreepackError);
    return e as TreepackError;
  }
  throw new Error('expected a TreepackError');
}

describe('bench --data for the training step', () => {
  it('names a missing file', () => {
    const missing = join(dir, 'nope.jsonl');
    const e = thrown(() => mixedRewardTasks(missing, out, 1));
    expect(e.code).toBe('E_IO');
    expect(e.where.file).toBe(missing);
    expect(e.message).toContain(missing);
  });

  it('names the file and line of a malformed record', () => {
    const bad = join(dir, 'bad.jsonl');
    writeFileSync(bad, `${episode('a', 1)}\n\n${episode('a', 0)}\n{"task_id": "b", meta\n`);
    const e = thrown(() => mixedRewardTasks(bad, out, 1));
    expect(e.code).toBe('E_INPUT');
    expect(e.where).toMatchObject({ file: bad, line: 4 });
    expect(e.message).toMatch(/malformed JSON/);
  });

  it('refuses a file where no task has mixed rewards', () => {
    const same = join(dir, 'same.jsonl');
    writeFileSync(same, `${episode('a', 1)}\n${episode('a', 1)}\n`);
    expect(thrown(() => mixedRewardTasks(same, out, 1)).code).toBe('E_INPUT');
  });

  it('keeps the first tasks with mixed rewards, whole', () => {
    const good = join(dir, 'good.jsonl');
    const lines = [episode('a', 1), episode('a', 1), episode('b', 0), episode('c', 1), episode('b', 1), episode('c', 0), episode('c', 0)];
    writeFileSync(good, lines.join('\n') + '\n');
    expect(mixedRewardTasks(good, out, 1)).toBe(2);
    expect(readFileSync(out, 'utf8')).toBe(`${lines[2]}\n${lines[4]}\n`);
    expect(mixedRewardTasks(good, out, 5)).toBe(5);
  });
});

describe('bench report paths', () => {
  // Checked before the run: a path that cannot be written fails in seconds, naming the flag, not after a 30-minute run.
  it.each([['--json'], ['--html']])('%s under a file (not a directory) exits 2 naming the flag', (flag) => {
    const file = join(dir, 'a-file');
    writeFileSync(file, '');
    const r = spawnSync(process.execPath, ['--import', 'tsx', 'bench/main.ts', flag, join(file, 'sub', 'bench.json')], {
      encoding: 'utf8',
      timeout: 120_000,
    });
    expect(r.status).toBe(2);
    expect(r.stderr).toContain(`bench: ${flag} ${join(file, 'sub', 'bench.json')}: cannot write there`);
    expect(r.stdout).not.toContain('## ');
  });
});

describe('bench generated workloads', () => {
  it('have different rewards inside every group, so the step check is not vacuous', () => {
    for (const g of GENERATED) {
      const episodes = withMixedRewards([...generateJsonlLines(g.opts)]).map((l) => JSON.parse(l) as EpisodeJson);
      const rewards = new Map<string, Set<number>>();
      for (const e of episodes) rewards.set(e.task_id, (rewards.get(e.task_id) ?? new Set()).add(e.meta.reward));
      for (const [task, r] of rewards) expect(r.size, `${g.label} ${task}`).toBe(2);
    }
  });
});
