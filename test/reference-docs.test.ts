/**
 * docs/reference stays true to the code: the generated pages (CLI, error codes, Python API) are current, the CLI page
 * shows what the built binary prints, every error code the sources raise is documented, and format.md lists exactly
 * the tensors, header keys and manifest fields the writer emits, with their dtypes and in the manifest's key order.
 */
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { GENERATED } from '../scripts/gen-docs.js';
import { pythonEnv } from '../scripts/python-env.mjs';
import { COMMANDS } from '../src/cli/commands.js';
import { ERROR_CODES } from '../src/errors.js';
import { DirectorySink } from '../src/io/directory-sink.js';
import { readManifest } from '../src/io/manifest.js';
import { readMicroBatch } from '../src/io/microbatch.js';
import { readSafetensors, writeSafetensors } from '../src/io/safetensors.js';
import { packRecords, type PackerOptions } from '../src/packer/index.js';
import { cli } from './helpers/cli.js';
import { caught } from './helpers/errors.js';
import { firstColumnNames, section, tableRows } from './helpers/markdown.js';

const root = fileURLToPath(new URL('..', import.meta.url));
const page = (name: string) => readFileSync(join(root, 'docs/reference', name), 'utf8');

/** Every file under `dir` (relative to the root) whose name ends with `ext`. */
function sources(dir: string, ext: string): string[] {
  return (readdirSync(join(root, dir), { recursive: true }) as string[]).filter((f) => f.endsWith(ext)).map((f) => join(root, dir, f));
}

describe('generated reference pages (npm run gen:docs)', () => {
  for (const g of GENERATED.filter((g) => !g.path.endsWith('python.md'))) {
    it(`${g.path} is current`, () => {
      expect(readFileSync(root + g.path, 'utf8'), `${g.path} is stale: run npm run gen:docs`).toBe(g.render());
    });
  }

  it('docs/reference/python.md is current', { timeout: 120_000 }, (ctx) => {
    const env = pythonEnv({ create: false });
    const trl = env.python && env.torch ? spawnSync(env.python, ['-c', 'import trl'], { encoding: 'utf8', timeout: 60_000 }).status === 0 : false;
    if (!env.python || !env.torch || !trl) {
      const why = !env.python || !env.torch ? env.reason : `${env.python} cannot import trl (treepack.integrations.trl is documented from it)`;
      if (process.env.TREEPACK_REQUIRE_TORCH === '1') throw new Error(`TREEPACK_REQUIRE_TORCH=1 but ${why}`);
      return ctx.skip(why);
    }
    const g = GENERATED.find((x) => x.path.endsWith('python.md'))!;
    expect(readFileSync(root + g.path, 'utf8'), `${g.path} is stale: run npm run gen:docs`).toBe(g.render());
  });

  it("cli.md shows what the built binary's --help prints, for every command", () => {
    const cliPage = page('cli.md');
    const top = cli(['--help']);
    expect(top.code).toBe(0);
    expect(cliPage).toContain('```text\n' + top.stdout.trimEnd() + '\n```');
    for (const name of Object.keys(COMMANDS)) {
      const r = cli([name, '--help']);
      expect(r.code, name).toBe(0);
      expect(cliPage, `treepack ${name} --help`).toContain(`## treepack ${name}\n\n\`\`\`text\n${r.stdout.trimEnd()}\n\`\`\``);
    }
  });

  it('errors.md documents every error code the TypeScript and Python sources raise, and each documented code is raised', () => {
    const documented = firstColumnNames(section(page('errors.md'), 'TreepackError codes'));
    expect(documented.sort()).toEqual(Object.keys(ERROR_CODES).sort());
    const ts = new Set(sources('src', '.ts').flatMap((f) => [...readFileSync(f, 'utf8').matchAll(/'(E_[A-Z]+)'/g)].map((m) => m[1])));
    const py = new Set(sources('python/treepack', '.py').flatMap((f) => [...readFileSync(f, 'utf8').matchAll(/"(E_[A-Z]+)"/g)].map((m) => m[1])));
    for (const code of [...ts, ...py]) expect(documented, `${code} is raised but not in ERROR_CODES`).toContain(code);
    for (const code of documented) expect(ts.has(code) || py.has(code), `${code} is documented but never raised`).toBe(true);
    const statuses = tableRows(section(page('errors.md'), 'C ABI status codes'));
    const header = readFileSync(join(root, 'native/core/abi.h'), 'utf8');
    for (const [num, name] of statuses) expect(header).toContain(`${name.replace(/`/g, '')} = ${num}`);
  });
});

/** Pre-tokenized samples sharing prefixes, each with every per-occurrence field a sample may carry. */
function samples(shared: boolean) {
  const seqs = shared ? [[1, 2, 3, 4], [1, 2, 5], [1, 7, 8, 9, 10], [1, 7, 8, 11]] : [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]];
  return seqs.map((tokens, i) => {
    const lp = tokens.map((_, t) => -0.1 * (t + 1));
    return { id: `s${i}`, group: `g${i >> 1}`, tokens, reward: i % 2, old_logprobs: lp, ref_logprobs: lp, rollout_logprobs: lp };
  });
}

interface Written {
  tensors: Map<string, string>; // name → dtype
  header: Set<string>;
  manifest: string[][]; // each manifest's top-level keys, in order
  entries: Set<string>;
  costModel: Set<string>;
}

/** Packs with `options` into a new directory and collects the names the writer emitted. */
async function written(opts: PackerOptions, shared: boolean, into: Written): Promise<void> {
  const dir = join(mkdtempSync(join(tmpdir(), 'tp-refdocs-')), 'out');
  const manifest = await packRecords(samples(shared), { vocabSize: 100, ...opts }).writeTo(new DirectorySink(dir));
  const raw = JSON.parse(readFileSync(join(dir, 'manifest.json'), 'utf8')) as Record<string, unknown>;
  into.manifest.push(Object.keys(raw));
  for (const k of Object.keys((raw.cost_model as object | undefined) ?? {})) into.costModel.add(k);
  for (const e of manifest.micro_batches) {
    for (const k of Object.keys(e)) into.entries.add(k);
    const file = readSafetensors(join(dir, e.file));
    for (const [name, t] of file.tensors) into.tensors.set(name, t.dtype);
    for (const k of Object.keys(file.metadata)) into.header.add(k);
  }
}

describe('format.md', () => {
  const format = page('format.md');

  it('lists exactly the tensors, header keys and manifest fields the writer emits, with their dtypes', { timeout: 60_000 }, async () => {
    const w: Written = { tensors: new Map(), header: new Set(), manifest: [], entries: new Set(), costModel: new Set() };
    // Between them these runs switch on every optional part of the format.
    const budget = { maxTokens: 8, dp: 2 };
    await written({ turnIds: true, masks: 'block:4,slices', maskBackend: 'js', budget: { ...budget, padMultiple: 4 } }, true, w);
    await written({ budget: { maxTokens: 4, prefixCacheTokens: 16, prefixBytesPerToken: 10 } }, true, w);
    await written({ masks: 'cu_seqlens', maskBackend: 'js' }, false, w);

    const tensorRows = tableRows(section(format, 'Tensors'));
    const documentedTensors = new Map(tensorRows.map((r) => [r[0].replace(/`/g, ''), r[1]]));
    expect([...documentedTensors.keys()].sort()).toEqual([...w.tensors.keys()].sort());
    for (const [name, dtype] of w.tensors) expect(documentedTensors.get(name), name).toBe(dtype);

    expect(firstColumnNames(section(format, 'Header metadata (`__metadata__`)')).sort()).toEqual([...w.header].sort());
    expect(firstColumnNames(section(format, '`micro_batches` entries')).sort()).toEqual([...w.entries].sort());

    const top = firstColumnNames(section(format, 'Top-level fields'));
    expect([...top].sort()).toEqual([...new Set(w.manifest.flat())].sort());
    // "Keys are written in this order": each manifest's keys are the documented list with some left out.
    for (const keys of w.manifest) expect(keys).toEqual(top.filter((k) => keys.includes(k)));
    expect([...w.costModel].sort()).toEqual(['a', 'b']);
    expect(format).toContain('| `cost_model` | object `{a, b}` |');
  });

  it('required tensors and header keys are the ones a reader refuses to miss', () => {
    const mb = readMicroBatch; // the reader is the authority on "required"
    const dir = mkdtempSync(join(tmpdir(), 'tp-refdocs-req-'));
    // The contract's table (its fourth column says required: yes or no), not the mask lowerings'.
    const tensorRows = tableRows(section(format, 'Tensors')).filter((r) => r[3] === 'yes' || r[3] === 'no');
    const headerRows = tableRows(section(format, 'Header metadata (`__metadata__`)'));
    // A valid one-sequence file, then each name left out in turn.
    const i32 = (xs: number[]) => ({ dtype: 'I32' as const, shape: [xs.length], data: Int32Array.from(xs) });
    const tensors = new Map([
      ['input_ids', i32([5, 6])],
      ['position_ids', i32([0, 1])],
      ['parent', i32([-1, 0])],
      ['subtree_end', i32([2, 2])],
      ['seq_offsets', i32([0, 2])],
      ['seq_positions', i32([0, 1])],
      ['loss_mask', { dtype: 'U8' as const, shape: [2], data: Uint8Array.from([0, 1]) }],
    ]);
    const metadata: Record<string, string> = { format: 'treepack/1', num_sequences: '1', num_tokens_naive: '2', num_tokens_packed: '2', tokenizer: 't', sequence_ids: '["a"]' };
    const path = join(dir, 'mb.safetensors');
    writeSafetensors(path, tensors, metadata);
    expect(mb(path).batch.input_ids).toEqual(Int32Array.from([5, 6]));
    const refused = (t: Map<string, unknown>, m: Record<string, string>) => {
      writeSafetensors(path, t as typeof tensors, m);
      return caught(() => mb(path))?.code === 'E_INPUT';
    };
    for (const [name, , , required] of tensorRows) {
      const n = name.replace(/`/g, '');
      const without = new Map(tensors);
      without.delete(n);
      if (tensors.has(n)) expect(refused(without, metadata), `tensor ${n}`).toBe(required === 'yes');
      else expect(required, `tensor ${n}`).toBe('no');
    }
    for (const [name, , required] of headerRows) {
      const k = name.replace(/`/g, '');
      const { [k]: _, ...without } = metadata;
      if (k in metadata) expect(refused(tensors, without), `header key ${k}`).toBe(required === 'yes');
      else expect(required, `header key ${k}`).toBe('no');
    }
  });

  it('a reader refuses a format it does not know, as the Versioning section says', () => {
    const dir = mkdtempSync(join(tmpdir(), 'tp-refdocs-ver-'));
    writeFileSync(join(dir, 'manifest.json'), JSON.stringify({ format: 'treepack/2', micro_batches: [] }));
    const err = caught(() => readManifest(dir));
    expect(err?.code).toBe('E_INPUT');
    expect(err?.message).toContain('format is "treepack/2", expected "treepack/1"');
    expect(format.replace(/\s+/g, ' ')).toContain('"format is "treepack/2", expected "treepack/1""');
  });
});
