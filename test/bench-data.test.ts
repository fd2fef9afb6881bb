/**
 * The bench's tau-bench input for the training step (`--data FILE`): a missing or malformed file is a TreepackError
 * naming the file (and the line), which the step section reports as that workload FAILED while the generated
 * workloads still run; a good file keeps only the first tasks whose episodes' rewards differ.
 */
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { TreepackError } from '../src/index.js';
import { mixedRewardTasks } from '../bench/step.js';

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
