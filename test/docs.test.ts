/**
 * Every fenced block labelled `ts`, `sh` or `python` in README.md and docs/**\/*.md runs as written, so the docs
 * cannot drift from the code. Blocks labelled `text`, `json`, `jsonl`, `console` or `http` are not programs and do
 * not run; `pycon` blocks (the docstrings' doctests in the generated python.md) run in python/tests/test_doctests.py,
 * not here; any other label, or none, fails (a typo such as `bash` would otherwise silently stop a block running).
 * Commands that change the machine (npm install, pip install, the whole test suite) go in `console` blocks.
 *
 * The convention a page is written to:
 * - A page's blocks run in order, as a reader follows it, in one fresh directory per page (the working directory)
 *   that holds `rollouts.jsonl`: generated agent episodes (bench/dataset.ts `generateJsonl`, chat-episode lines).
 *   A block may use what an earlier block of its page wrote (`packed/` after a `treepack pack … --out packed/`).
 * - `sh` runs under bash with errexit and pipefail; `treepack` on PATH is this checkout's CLI (dist/), `python` the
 *   Python the Python suites use with PYTHONPATH=python, and `ENGINE` the base URL (…/v1) of a stub
 *   OpenAI-compatible engine (test/helpers/stub-engine.ts) standing in for vLLM. A block that starts a server in the
 *   background stops it itself; whatever of its process group is left is killed after it.
 * - `ts` runs with tsx; `import … from 'treepack'` (and `treepack/ops`, `treepack/serve`) is this checkout, through
 *   the package's own exports.
 * - `python` runs with that Python and PYTHONPATH=python (the C core found in build/Release); it is skipped, with
 *   the reason, where there is no Python with numpy and safetensors or the C core is not built. So is an `sh` block
 *   that runs `python`.
 * - `<!-- needs: torch -->` (or `cuda`, `redis`; several separated by commas) on the line before a block says it
 *   needs an optional part: without it the block is skipped with the reason, and under the part's
 *   TREEPACK_REQUIRE_* variable (TREEPACK_REQUIRE_TORCH, _CUDA, _REDIS) it fails instead. `torch` means torch,
 *   transformers and the trainer integrations of python/requirements-torch.txt. A Python block that imports torch
 *   must say so (checked below). No block may need ../shared or the network.
 */
import { spawn, spawnSync } from 'node:child_process';
import { chmodSync, existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { basename, join, relative, resolve } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { generateJsonl } from '../bench/dataset.js';
import { disposeBackends, listBackends } from '../src/backend/index.js';
import { readManifest } from '../src/io/manifest.js';
import { readMicroBatch } from '../src/io/microbatch.js';
import { checkForest } from '../src/pack/invariants.js';
import { pythonEnv } from '../scripts/python-env.mjs';
import { REQUIRE_ENV } from './helpers/backends.js';
import { cli } from './helpers/cli.js';
import { redisAvailable } from './helpers/redis.js';
import { startStubEngine, type StubEngine } from './helpers/stub-engine.js';

const root = resolve(__dirname, '..');
const RUN = ['ts', 'sh', 'python'] as const;
// `pycon` blocks are the docstrings' doctests in the generated python.md: python/tests/test_doctests.py runs them.
const INERT = ['text', 'json', 'jsonl', 'console', 'http', 'pycon'];
const NEEDS = { torch: 'TREEPACK_REQUIRE_TORCH', cuda: REQUIRE_ENV.cuda!, redis: 'TREEPACK_REQUIRE_REDIS' } as const;
type Need = keyof typeof NEEDS;

interface Block {
  file: string;
  line: number;
  lang: string;
  code: string;
  needs: string[];
}

/** The fenced blocks of a markdown page, each with its label, first line and the needs of the comment before it. */
function blocksOf(file: string, text: string): Block[] {
  const lines = text.split('\n');
  const blocks: Block[] = [];
  for (let i = 0; i < lines.length; i++) {
    const open = /^(\s*)(`{3,}|~{3,})\s*([^\s`]*)/.exec(lines[i]);
    if (!open) continue;
    const [, indent, fence, lang] = open;
    let j = i + 1;
    while (j < lines.length && !(lines[j].startsWith(indent + fence) && lines[j].trim() === fence)) j++;
    let k = i - 1;
    while (k >= 0 && lines[k].trim() === '') k--;
    const needs =
      /^\s*<!--\s*needs:\s*([^>]*?)\s*-->\s*$/
        .exec(lines[k] ?? '')?.[1]
        .split(',')
        .map((s) => s.trim()) ?? [];
    const body = lines.slice(i + 1, j).map((l) => (l.startsWith(indent) ? l.slice(indent.length) : l));
    blocks.push({ file, line: i + 1, lang, code: body.join('\n') + '\n', needs });
    i = j;
  }
  return blocks;
}

/** README.md and every page under docs/, found by walking the tree so pages added later are covered. */
function pages(): string[] {
  const found = ['README.md'];
  const walk = (dir: string) => {
    for (const e of readdirSync(join(root, dir), { withFileTypes: true })) {
      const p = join(dir, e.name);
      if (e.isDirectory()) walk(p);
      else if (e.name.endsWith('.md')) found.push(p);
    }
  };
  if (existsSync(join(root, 'docs'))) walk('docs');
  return found.sort((a, b) => (a === 'README.md' ? -1 : b === 'README.md' ? 1 : a.localeCompare(b)));
}

const python = pythonEnv({ create: false });
// Its path: the shim put on PATH as `python` must not find itself.
const pythonPath =
  python.python === null
    ? null
    : python.python.includes('/')
      ? resolve(root, python.python)
      : spawnSync('sh', ['-c', `command -v ${python.python}`], { encoding: 'utf8' }).stdout.trim();
const coreBuilt = existsSync(join(root, 'build/Release/libtreepack_core.so')) || existsSync(join(root, 'build-cmake/libtreepack_core.so'));
let importsSafetensors: boolean | undefined;
/** Whether that Python reads micro-batch files (treepack reads them with the safetensors library). */
const safetensors = () => (importsSafetensors ??= spawnSync(pythonPath!, ['-c', 'import safetensors'], { cwd: root }).status === 0);
let cudaReason: string | undefined;
let redisReason: string | undefined;

/** Why `block` cannot run here ('' when it can); throws where a TREEPACK_REQUIRE_* variable demands the part. */
function skipReason(block: Block): string {
  const require = (env: string | undefined, reason: string) => {
    if (reason && env && process.env[env] === '1') throw new Error(`${block.file}:${block.line}: ${env}=1 but ${reason}`);
    return reason;
  };
  for (const need of block.needs) {
    if (!(need in NEEDS)) throw new Error(`${block.file}:${block.line}: unknown need '${need}' (known: ${Object.keys(NEEDS).join(', ')})`);
    const env = NEEDS[need as Need];
    let reason = '';
    if (need === 'torch') reason = python.torch ? '' : `needs torch: ${python.reason}`;
    if (need === 'cuda') reason = cudaReason ?? '';
    if (need === 'redis') reason = redisReason ?? '';
    if (require(env, reason)) return reason;
  }
  if (block.lang === 'python' || (block.lang === 'sh' && /\bpython3?\b/.test(block.code))) {
    if (python.python === null) return require(NEEDS.torch, `no Python with numpy: ${python.reason}`);
    if (!safetensors()) return require(NEEDS.torch, `${python.python} cannot import safetensors (pip install ./python installs it)`);
    if (!coreBuilt) return require('TREEPACK_REQUIRE_NATIVE', 'the C core is not built (npm install or npm run build:native)');
  }
  return '';
}

interface Ran {
  code: number | null;
  stdout: string;
  stderr: string;
}

/** Runs a command in its own process group and kills what is left of the group when it ends (a server it forgot). */
function runGroup(cmd: string, args: string[], cwd: string, env: NodeJS.ProcessEnv, timeoutMs: number): Promise<Ran> {
  return new Promise((done) => {
    const child = spawn(cmd, args, { cwd, env, detached: true, stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d: Buffer) => (stdout += d.toString()));
    child.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
    const killGroup = () => {
      try {
        process.kill(-child.pid!, 'SIGKILL');
      } catch {
        // the group is gone
      }
    };
    const timer = setTimeout(() => {
      stderr += `\n[docs test: killed after ${timeoutMs} ms]`;
      killGroup();
    }, timeoutMs);
    child.on('close', (code) => {
      clearTimeout(timer);
      killGroup();
      done({ code, stdout, stderr });
    });
  });
}

// Made when the tests start (not at collection), so a file that fails to collect leaves nothing behind.
let work = '';
let bin = '';
let stub: StubEngine;
const rollouts = generateJsonl({ groups: 2, episodesPerGroup: 2, minTurns: 2, maxTurns: 4 });

beforeAll(async () => {
  work = mkdtempSync(join(tmpdir(), 'treepack-docs-'));
  bin = join(work, 'bin');
  mkdirSync(bin);
  writeFileSync(
    join(bin, 'treepack'),
    `#!/bin/sh\nexec ${JSON.stringify(process.execPath)} ${JSON.stringify(join(root, 'dist/src/cli/main.js'))} "$@"\n`,
  );
  if (pythonPath) {
    for (const name of ['python', 'python3']) writeFileSync(join(bin, name), `#!/bin/sh\nexec ${JSON.stringify(pythonPath)} "$@"\n`);
  }
  for (const f of readdirSync(bin)) chmodSync(join(bin, f), 0o755);
  stub = await startStubEngine();
});
afterAll(async () => {
  await stub?.close();
  if (work) rmSync(work, { recursive: true, force: true });
});

/** Runs one block in `dir`; returns what it printed. */
async function runBlock(block: Block, dir: string, n: number): Promise<Ran> {
  const env: NodeJS.ProcessEnv = {
    ...process.env,
    PATH: `${bin}:${process.env.PATH}`,
    PYTHONPATH: join(root, 'python'),
    PYTHONDONTWRITEBYTECODE: '1',
    OMP_NUM_THREADS: '1',
    ENGINE: stub.url,
  };
  const timeout = block.needs.includes('torch') ? 300_000 : 120_000;
  if (block.lang === 'sh') {
    writeFileSync(join(dir, `.block-${n}.sh`), block.code);
    return runGroup('bash', ['-eo', 'pipefail', `.block-${n}.sh`], dir, env, timeout);
  }
  if (block.lang === 'python') {
    writeFileSync(join(dir, `.block-${n}.py`), block.code);
    return runGroup(join(bin, 'python'), [`.block-${n}.py`], dir, env, timeout);
  }
  // Inside the package, so that `import … from 'treepack'` resolves to this checkout through its exports.
  const script = join(root, `.docs-block-${process.pid}-${n}.mts`);
  writeFileSync(script, block.code);
  try {
    return await runGroup(process.execPath, ['--import', join(root, 'node_modules/tsx/dist/loader.mjs'), script], dir, env, timeout);
  } finally {
    rmSync(script, { force: true });
  }
}

/** What a page's blocks must have left behind, beyond exiting 0 (the checks the README's examples carried). */
const after: Record<string, { reads: string; check: (dir: string, out: string[]) => void }> = {
  'README.md': {
    reads: 'packed/manifest.json',
    check: (dir) => {
      const manifest = readManifest(join(dir, 'packed'));
      expect(manifest.micro_batches.length).toBeGreaterThan(0);
      for (const m of manifest.micro_batches) expect(checkForest(readMicroBatch(join(dir, 'packed', m.file)).batch)).toEqual([]);
    },
  },
  'docs/guides/packing.md': {
    reads: 'packed-lib/manifest.json',
    check: (dir, out) => {
      const manifest = JSON.parse(readFileSync(join(dir, 'packed-lib/manifest.json'), 'utf8'));
      expect(manifest).toMatchObject({ max_tokens: 32768, dp: 8, pad_multiple: 128, masks: ['block:128'] });
      expect(manifest.micro_batches.length % 8).toBe(0);
      expect(out.join('')).toContain(
        `${manifest.naive_tokens} → ${manifest.packed_tokens} tokens in ${manifest.micro_batches.length} micro-batches`,
      );
      for (const m of manifest.micro_batches) {
        const { batch, extra, extraMeta } = readMicroBatch(join(dir, 'packed-lib', m.file));
        expect(checkForest(batch)).toEqual([]);
        expect(batch.input_ids.length % 128).toBe(0);
        expect(extra.has('block_kv_indices')).toBe(true);
        expect(extraMeta.block_size).toBe('128');
      }
      // createPacker's micro-batches, pushed one record at a time, are the CLI's files (names and bytes).
      const cliOut = join(dir, 'cli-100k');
      const r = cli([
        'pack',
        join(dir, 'rollouts.jsonl'),
        '--out',
        cliOut,
        '--max-naive-tokens',
        '100000',
        '--tokenizer',
        'qwen3',
        '--quiet',
      ]);
      expect(r.code, r.stderr).toBe(0);
      const files = readManifest(cliOut).micro_batches.map((m) => `${basename(m.file)} ${readFileSync(join(cliOut, m.file)).length}`);
      expect(out.map((o) => o.trim().split('\n'))).toContainEqual(files);
    },
  },
};

it('the blocks parser: labels, needs, nesting', () => {
  const page = [
    '<!-- needs: torch, redis -->',
    '```python',
    'x = 1',
    '```',
    '',
    '```text',
    'not run',
    '```',
    '- item:',
    '',
    '  ```sh',
    '  echo hi',
    '  ```',
  ].join('\n');
  expect(blocksOf('p.md', page)).toEqual([
    { file: 'p.md', line: 2, lang: 'python', code: 'x = 1\n', needs: ['torch', 'redis'] },
    { file: 'p.md', line: 6, lang: 'text', code: 'not run\n', needs: [] },
    { file: 'p.md', line: 11, lang: 'sh', code: 'echo hi\n', needs: [] },
  ]);
});

const all = pages().map((file) => ({ file, blocks: blocksOf(file, readFileSync(join(root, file), 'utf8')) }));
const needed = new Set(all.flatMap(({ blocks }) => blocks.flatMap((b) => b.needs)));
// Backends and redis-server are probed only when a block needs them (starting the backends starts WebGPU's device).
if (needed.has('cuda')) {
  const cuda = (await listBackends()).find((b) => b.name === 'cuda');
  cudaReason = cuda?.available ? '' : `needs the cuda backend: ${cuda?.detail ?? 'not registered'}`;
  afterAll(disposeBackends);
}
if (needed.has('redis'))
  redisReason = redisAvailable('docs blocks that need redis') ? '' : 'needs redis-server (apt-get install redis-server)';

it('every block is labelled as a program or as inert text; Python blocks that import torch say they need it', () => {
  const bad = all.flatMap(({ blocks }) =>
    blocks.filter((b) => ![...RUN, ...INERT].includes(b.lang)).map((b) => `${b.file}:${b.line} '${b.lang}'`),
  );
  expect(bad, `label each block one of ${[...RUN, ...INERT].join(', ')}`).toEqual([]);
  const torch = all.flatMap(({ blocks }) =>
    blocks.filter(
      (b) =>
        b.lang === 'python' &&
        /^\s*(import|from)\s+(torch|transformers|trl|treepack\.torch|treepack\.integrations)\b/m.test(b.code) &&
        !b.needs.includes('torch'),
    ),
  );
  expect(
    torch.map((b) => `${b.file}:${b.line}`),
    'add <!-- needs: torch --> before these blocks',
  ).toEqual([]);
  const shared = all.flatMap(({ blocks }) => blocks.filter((b) => RUN.includes(b.lang as never) && b.code.includes('../shared')));
  expect(
    shared.map((b) => `${b.file}:${b.line}`),
    'doc blocks must not need ../shared',
  ).toEqual([]);
  expect(all.find((p) => p.file === 'README.md')!.blocks.some((b) => b.lang === 'sh')).toBe(true);
});

/** GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens. */
const slug = (heading: string) =>
  heading
    .trim()
    .toLowerCase()
    .replace(/[^\p{L}\p{N}\- _]/gu, '')
    .replaceAll(' ', '-');

/** The relative links of a page (outside code blocks and code spans), as [target path, anchor]. */
function linksOf(file: string, text: string): { target: string; anchor: string }[] {
  const prose = text.replace(/^(\s*)(`{3,}|~{3,})[\s\S]*?^\1\2\s*$/gm, '').replace(/`[^`\n]*`/g, '');
  return [...prose.matchAll(/\]\(([^)\s]+)\)/g)]
    .map((m) => m[1])
    .filter((href) => !/^[a-z]+:/i.test(href))
    .map((href) => {
      const [path, anchor = ''] = href.split('#');
      return { target: path === '' ? file : join(file, '..', path), anchor };
    });
}

/** Pages written apart from these docs (the generated reference, the agent APIs guide): a link to one that does not
 * exist yet is reported as unchecked, by name, rather than failing; once it exists it is checked like any other. */
const WRITTEN_APART = ['docs/reference/', 'docs/guides/agent-apis.md'];

it('every relative link and anchor of README.md and docs/ resolves', (ctx) => {
  const broken: string[] = [];
  const unchecked = new Set<string>();
  for (const { file } of all) {
    for (const { target, anchor } of linksOf(file, readFileSync(join(root, file), 'utf8'))) {
      if (!existsSync(join(root, target))) {
        if (WRITTEN_APART.some((p) => target.startsWith(p))) unchecked.add(target);
        else broken.push(`${file}: ${target}`);
      } else if (anchor && target.endsWith('.md')) {
        const headings = readFileSync(join(root, target), 'utf8')
          .split('\n')
          .filter((l) => /^#{1,6} /.test(l))
          .map((l) => slug(l.replace(/^#+ /, '')));
        if (!headings.includes(anchor)) broken.push(`${file}: ${target}#${anchor}`);
      }
    }
  }
  expect(broken).toEqual([]);
  if (unchecked.size) {
    const reason = `links to pages not written yet: ${[...unchecked].sort().join(', ')}`;
    console.log(`docs links skipped: ${reason}`);
    ctx.skip(reason);
  }
});

for (const { file, blocks } of all) {
  const runnable = blocks.filter((b) => RUN.includes(b.lang as never));
  if (runnable.length === 0) continue;
  describe(file, () => {
    let dir = '';
    const out: string[] = [];
    let failed = '';
    beforeAll(() => {
      dir = join(work, file.replaceAll('/', '_'));
      mkdirSync(dir, { recursive: true });
      writeFileSync(join(dir, 'rollouts.jsonl'), rollouts);
    });
    const skipped: string[] = [];
    runnable.forEach((block, n) => {
      let reason: string;
      try {
        reason = skipReason(block);
      } catch (e) {
        it(`${file}:${block.line} ${block.lang}`, () => {
          throw e;
        });
        return;
      }
      if (reason) {
        console.log(`${file}:${block.line} ${block.lang} skipped: ${reason}`);
        skipped.push(`${file}:${block.line}`);
      }
      it.skipIf(reason !== '')(
        `${file}:${block.line} ${block.lang}${reason ? ` (skipped: ${reason})` : ''}`,
        async () => {
          // A page is one script: once a block failed, those after it report that instead of failing for it.
          expect(failed, 'an earlier block of this page failed').toBe('');
          const r = await runBlock(block, dir, n);
          out.push(r.stdout);
          if (r.code !== 0) failed = `${file}:${block.line}`;
          expect(
            r.code,
            `${file}:${block.line} (${block.lang}) exited ${r.code} in ${relative(root, dir)}\n--- stdout\n${r.stdout}\n--- stderr\n${r.stderr}`,
          ).toBe(0);
        },
        330_000,
      );
    });
    if (after[file]) {
      const { reads, check } = after[file];
      it(`${file}: what its blocks wrote`, (ctx) => {
        expect(failed).toBe('');
        // Only where the block that writes it did not run here (a skipped part) is its absence not a failure.
        if (!existsSync(join(dir, reads)) && skipped.length) ctx.skip(`${reads} not written: ${skipped.join(', ')} skipped`);
        check(dir, out);
      });
    }
  });
}
