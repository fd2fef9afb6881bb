/**
 * The option table is the one place an option is declared: walked entry by entry, each option's flag is listed by
 * `treepack pack --help` (and by `stats --help` unless it shapes only the written files), a bad value is exit 2
 * naming the flag and E_ARG naming the option, and the default reaches the report and manifest.json where the
 * entry says it does.
 */
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { createPacker, loadTokenizer, MemorySink, packRecords, TreepackError } from '../src/index.js';
import { getPath, groupOf, OPTION_TABLE, setPath, type OptionEntry } from '../src/packer/option-table.js';
import { resolveOptions } from '../src/packer/options.js';
import { SERVE_PACKER_OPTIONS } from '../src/cli/serve.js';
import { resolveServiceOptions, sharedConfig } from '../src/serve/options.js';
import { generateTokenSamples } from '../bench/dataset.js';
import { cli } from './helpers/cli.js';
import { caught } from './helpers/errors.js';

const dir = mkdtempSync(join(tmpdir(), 'treepack-options-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const input = join(dir, 'tokens.jsonl');
writeFileSync(
  input,
  [...generateTokenSamples({ groups: 2, episodesPerGroup: 2, minTurns: 2, maxTurns: 3, seed: 4 })]
    .map((s) => JSON.stringify(s))
    .join('\n') + '\n',
);

/** A budget large enough for every sequence of `input`: the value given to a group's required option. */
const BUDGET = 100_000;

/**
 * A bad value per option, as a flag's text and as a library value. A switch's bad flag is `--flag=text` (a switch
 * takes no value). An option added to the table needs its line here.
 */
const BAD: Record<string, { flag: string; lib: unknown }> = {
  tokenizer: { flag: '', lib: '' },
  backend: { flag: 'tpu', lib: 'gpu' },
  windowTokens: { flag: '1e3x', lib: 0 },
  vocabSize: { flag: '', lib: 2.5 },
  'budget.maxTokens': { flag: '0', lib: 'many' },
  'budget.dp': { flag: 'two', lib: 0 },
  'budget.padMultiple': { flag: '0', lib: -8 },
  'budget.padTokenId': { flag: '-1', lib: 1.5 },
  'budget.cost.a': { flag: '-1', lib: Number.NaN },
  'budget.cost.b': { flag: 'x', lib: Number.POSITIVE_INFINITY },
  'budget.balanceSlack': { flag: '-0.5', lib: '0.1' },
  'budget.prefixCacheTokens': { flag: '-1', lib: 2.5 },
  'budget.prefixBytesPerToken': { flag: 'x', lib: -1 },
  'budget.sharedPrefix': { flag: 'x', lib: 'yes' },
  'budget.cp': { flag: '0', lib: 1.5 },
  'budget.kvBytesPerToken': { flag: 'x', lib: -1 },
  'budget.linkBytesPerToken': { flag: '-1', lib: 'fast' },
  merge: { flag: 'x', lib: 'off' },
  'merge.timelineCompareLevel': { flag: 'char', lib: 'bytes' },
  repeatedEpisodeIds: { flag: 'yes', lib: 'yes' },
  lossyUtf8: { flag: '1', lib: 1 },
  turnIds: { flag: 'yes', lib: 'yes' },
  routeConflict: { flag: 'last', lib: true },
  advantages: { flag: 'ppo', lib: 'ppo' },
  masks: { flag: 'block:0', lib: 'flash' },
  maskBackend: { flag: 'tpu', lib: 'npu' },
};

/** The other flags of the entry's group that it needs (`--max-tokens` beside `--dp`). */
const requiredBeside = (e: OptionEntry) => OPTION_TABLE.filter((r) => r !== e && r.required && groupOf(r) === groupOf(e));
const escape = (s: string) => s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
/** The --help line that lists the flag (a flag also appears inside other flags' help text). */
const listed = (help: string, e: OptionEntry) => new RegExp(`^  ${escape(e.flag)}${e.metavar ? ` ${e.metavar}` : ''}( |$)`, 'm').test(help);

describe('every option of the table', () => {
  it('has a flag that pack --help lists, and stats --help unless it shapes only the output', () => {
    const pack = cli(['pack', '--help']).stdout;
    const stats = cli(['stats', '--help']).stdout;
    expect(new Set(OPTION_TABLE.map((e) => e.flag)).size).toBe(OPTION_TABLE.length);
    for (const e of OPTION_TABLE) {
      expect(listed(pack, e), `${e.flag} in pack --help`).toBe(true);
      expect(listed(stats, e), `${e.flag} in stats --help`).toBe(!e.output);
    }
  });

  it('has a bad value in this test', () => {
    expect(Object.keys(BAD).sort()).toEqual(OPTION_TABLE.map((e) => e.option).sort());
  });

  for (const e of OPTION_TABLE) {
    it(`${e.flag} / ${e.option}: a bad value names the flag (exit 2) and the option (E_ARG)`, () => {
      const bad = BAD[e.option];
      const beside = requiredBeside(e).flatMap((r) => [r.flag, String(BUDGET)]);
      const r = cli(['pack', input, '--out', join(dir, 'never'), ...beside, `${e.flag}=${bad.flag}`]);
      expect(r.code, r.stderr).toBe(2);
      const first = r.stderr.split('\n')[0];
      expect(first).toContain(e.flag);
      const namesOption = new RegExp(`(for|in) ${escape(e.option)}( |$)`);
      expect(first).not.toMatch(namesOption);

      const opts: Record<string, unknown> = {};
      for (const req of requiredBeside(e)) setPath(opts, req.option, BUDGET);
      setPath(opts, e.option, bad.lib);
      const err = caught(() => createPacker(opts)) as TreepackError;
      expect(err).toBeInstanceOf(TreepackError);
      expect(err.code).toBe('E_ARG');
      expect(err.message).toMatch(namesOption);
      expect(err.message).not.toContain(e.flag);
    });
  }

  it('takes its default when left out, and the manifest shows it where the entry says', async () => {
    const out = join(dir, 'defaults');
    // With a budget, so that the budget's options take their defaults too; the tokenizer has none (chat input).
    const r = cli(['pack', input, '--out', out, '--max-tokens', String(BUDGET), '--tokenizer', 'qwen3', '--quiet']);
    expect(r.code, r.stderr).toBe(0);
    const manifest = JSON.parse(readFileSync(join(out, 'manifest.json'), 'utf8'));
    const run = packRecords(input, { budget: { maxTokens: BUDGET }, tokenizer: 'qwen3' });
    await run.writeTo(new MemorySink());
    const report = run.report();
    for (const e of OPTION_TABLE.filter((x) => x.manifest)) {
      const m = e.manifest!;
      const inReport = getPath(report, e.option);
      if (m.ran) {
        // What ran (a backend and why, the tokenizer's name): the report's words, in the manifest as they are.
        expect(getPath(manifest, m.key), m.key).toEqual(inReport);
        continue;
      }
      const value = e.default ?? (e.required ? BUDGET : undefined);
      const shown = m.show ? m.show(value as never) : value;
      expect(getPath(manifest, m.key), m.key).toEqual(shown);
      if (shown !== undefined) expect(inReport, e.option).toEqual(value);
    }
    // The same, written out: the defaults of `treepack pack --help`.
    expect(manifest).toMatchObject({ max_tokens: BUDGET, dp: 1, pad_multiple: 1, cost_model: { a: 1, b: 2.6e-5 } });
    expect(manifest).not.toHaveProperty('masks');
    expect(manifest).not.toHaveProperty('mask_backend');
    expect(report.budget).toMatchObject({ padTokenId: 0, balanceSlack: 0.01 });
  }, 60_000);
});

describe('the options treepack serve takes from the table', () => {
  it('are listed by serve --help, and a bad value names the flag (exit 2); --route-conflict among them', () => {
    expect(SERVE_PACKER_OPTIONS.map((e) => e.option)).toContain('routeConflict');
    const help = cli(['serve', '--help']).stdout.replace(/\s+/g, ' ');
    const base = ['serve', '--engine', 'http://127.0.0.1:1/v1', '--data', join(dir, 'never'), '--tokenizer', 'qwen3'];
    for (const e of SERVE_PACKER_OPTIONS) {
      expect(help, e.flag).toContain(e.metavar ? `${e.flag} ${e.metavar}` : e.flag);
      if (e.option === 'tokenizer') continue; // its bad value (blank) is the missing tokenizer's own message
      const beside = requiredBeside(e).flatMap((r) => [r.flag, String(BUDGET)]);
      const r = cli([...base, ...beside, `${e.flag}=${BAD[e.option].flag}`]);
      expect(r.code, r.stderr).toBe(2);
      expect(r.stderr, e.flag).toMatch(new RegExp(`for ${escape(e.flag)} but received`));
    }
  });

  it('the route policy is one every service on a shared pool must agree on', () => {
    const base = { engineUrl: 'http://127.0.0.1:1/v1', dataDir: join(dir, 'never') };
    const split = sharedConfig(resolveServiceOptions(base));
    expect(split.routeConflict).toBe('split');
    expect(sharedConfig(resolveServiceOptions({ ...base, packer: { routeConflict: 'first' } })).routeConflict).toBe('first');
  });
});

describe('resolveOptions', () => {
  it('fills every default and leaves the caller objects as they were', () => {
    const budget = { maxTokens: 64, cost: { a: 2 } };
    const merge = { ignoreTools: false };
    const r = resolveOptions({ budget: budget as never, merge });
    expect(r).toMatchObject({
      backend: 'auto',
      windowTokens: 4 * 1024 * 1024,
      advantages: 'grpo',
      masks: [],
      maskBackend: 'auto',
      repeatedEpisodeIds: false,
      lossyUtf8: false,
      turnIds: false,
      merge: { ignoreTools: false, timelineCompareLevel: 'text' },
      budget: { maxTokens: 64, dp: 1, padMultiple: 1, padTokenId: 0, cost: { a: 2, b: 2.6e-5 }, balanceSlack: 0.01 },
    });
    expect(r.tokenizer).toBeUndefined();
    expect(budget).toEqual({ maxTokens: 64, cost: { a: 2 } });
    expect(merge).toEqual({ ignoreTools: false });
    expect(resolveOptions({ merge: false }).merge).toBe(false);
  });

  it('names the level that is not an object', () => {
    expect(() => resolveOptions({ budget: 5 as never })).toThrow(/Expected an object for budget but received 5/);
    expect(() => resolveOptions({ budget: { maxTokens: 8, cost: 'cheap' as never } })).toThrow(/for budget\.cost but received "cheap"/);
    expect(() => resolveOptions({ budget: {} as never })).toThrow(/for budget\.maxTokens but received undefined/);
  });

  it("takes a loaded tokenizer as the caller's own object, and refuses another object naming tokenizer", async () => {
    const loaded = await loadTokenizer('qwen3');
    expect(resolveOptions({ tokenizer: loaded }).tokenizer).toBe(loaded);
    expect(() => resolveOptions({ tokenizer: { name: 'mine' } as never })).toThrow(/for tokenizer but received an object/);
  });

  it('names a function given for a value as a function, without printing its source', () => {
    const secret = () => 'source text of the caller';
    expect(() => resolveOptions({ budget: secret as never })).toThrow(/for budget but received a function$/);
  });
});

describe('the CLI takes only the flags given', () => {
  it('--no-merge makes --timeline-compare-level moot, as before; --dp needs --max-tokens', () => {
    expect(cli(['stats', input, '--no-merge', '--timeline-compare-level', 'token', '--json', '--tokenizer', 'qwen3']).code).toBe(0);
    const r = cli(['pack', input, '--out', join(dir, 'never'), '--pad-id', '3']);
    expect(r.code).toBe(2);
    expect(r.stderr).toMatch(/--pad-id needs --max-tokens T/);
  });
});
