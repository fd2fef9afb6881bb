/**
 * docs/reference stays true to the code: the generated pages (CLI, error codes, Python API) are current, the CLI page
 * shows what the built binary prints, every error code the sources raise is documented, and format.md lists exactly
 * the tensors, header keys and manifest fields the writer emits, with their dtypes and in the manifest's key order.
 */
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { dirname, join, relative } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { GENERATED } from '../scripts/gen-docs.js';
import { undocumentedExports } from '../scripts/undocumented-exports.js';
import { pythonEnv } from '../scripts/python-env.mjs';
import { vlTokenizerDir, writeImageWorkload } from '../bench/images.js';
import { BACKEND_NAMES, disposeBackends, listBackends } from '../src/backend/index.js';
import { COMMANDS } from '../src/cli/commands.js';
import { ERROR_CODES, type TreepackError } from '../src/errors.js';
import { DirectorySink } from '../src/io/directory-sink.js';
import { readManifest } from '../src/io/manifest.js';
import { readMicroBatch } from '../src/io/microbatch.js';
import { readSafetensors, writeSafetensors, type Tensor } from '../src/io/safetensors.js';
import { packRecords, type PackerOptions } from '../src/packer/index.js';
import type { PackInput } from '../src/packer/pack-records.js';
import { Service } from '../src/serve/index.js';
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
    const trl =
      env.python && env.torch ? spawnSync(env.python, ['-c', 'import trl'], { encoding: 'utf8', timeout: 60_000 }).status === 0 : false;
    if (!env.python || !env.torch || !trl) {
      const why =
        !env.python || !env.torch ? env.reason : `${env.python} cannot import trl (treepack.integrations.trl is documented from it)`;
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
    const py = new Set(
      sources('python/treepack', '.py').flatMap((f) => [...readFileSync(f, 'utf8').matchAll(/"(E_[A-Z]+)"/g)].map((m) => m[1])),
    );
    for (const code of [...ts, ...py]) expect(documented, `${code} is raised but not in ERROR_CODES`).toContain(code);
    for (const code of documented) expect(ts.has(code) || py.has(code), `${code} is documented but never raised`).toBe(true);
    const statuses = tableRows(section(page('errors.md'), 'C ABI status codes'));
    const header = readFileSync(join(root, 'native/core/abi.h'), 'utf8');
    for (const [num, name] of statuses) expect(header).toContain(`${name.replace(/`/g, '')} = ${num}`);
  });
});

/** Pre-tokenized samples sharing prefixes, each with every per-occurrence field a sample may carry. */
function samples(shared: boolean, routed = false) {
  const seqs = shared
    ? [
        [1, 2, 3, 4],
        [1, 2, 5],
        [1, 7, 8, 9, 10],
        [1, 7, 8, 11],
      ]
    : [
        [1, 2, 3],
        [4, 5],
        [6, 7, 8, 9],
        [10, 11],
      ];
  return seqs.map((tokens, i) => {
    const lp = tokens.map((_, t) => -0.1 * (t + 1));
    const routes = routed ? tokens.map((_, t) => [[t % 4, (t + 1) % 4]]) : undefined;
    return { id: `s${i}`, group: `g${i >> 1}`, tokens, reward: i % 2, old_logprobs: lp, ref_logprobs: lp, rollout_logprobs: lp, routes };
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
async function written(opts: PackerOptions, shared: boolean, into: Written, input: PackInput = samples(shared)): Promise<void> {
  const dir = join(mkdtempSync(join(tmpdir(), 'tp-refdocs-')), 'out');
  const manifest = await packRecords(input, { vocabSize: 100, ...opts }).writeTo(new DirectorySink(dir));
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
    // Shared prefixes (a prompt held by both ranks) and context parallelism (a chain one rank's cache cannot hold).
    await written({ budget: { maxTokens: 2, dp: 2, prefixCacheTokens: 16 } }, true, w);
    await written({ budget: { maxTokens: 2, dp: 2, prefixCacheTokens: 2, cp: 2 } }, true, w);
    await written({ masks: 'cu_seqlens', maskBackend: 'js' }, false, w);
    await written({ budget: { maxTokens: 8, prefixCacheTokens: 16, prefixBytesPerToken: 10 } }, true, w, samples(true, true));
    // Images: chat calls resending screenshots, for a vision-language tokenizer.
    const images = mkdtempSync(join(tmpdir(), 'tp-refdocs-images-'));
    const episodes = writeImageWorkload(images, { episodes: 1, steps: 2, height: 56, width: 56 });
    await written({ tokenizer: vlTokenizerDir(join(images, 'tokenizer')), vocabSize: undefined }, false, w, episodes);

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

  // The reader is the authority on "required": the page must say yes exactly where it refuses a file without the name.
  it('required tensors and header keys are the ones a reader refuses to miss', () => {
    const dir = mkdtempSync(join(tmpdir(), 'tp-refdocs-req-'));
    // The contract's table (its fourth column says required: yes or no), not the mask lowerings'.
    const tensorRows = tableRows(section(format, 'Tensors')).filter((r) => r[3] === 'yes' || r[3] === 'no');
    const headerRows = tableRows(section(format, 'Header metadata (`__metadata__`)'));
    // A valid one-sequence file, then each name left out in turn.
    const i32 = (xs: number[]) => ({ dtype: 'I32' as const, shape: [xs.length], data: Int32Array.from(xs) });
    const tensors = new Map<string, Tensor>([
      ['input_ids', i32([5, 6])],
      ['position_ids', i32([0, 1])],
      ['parent', i32([-1, 0])],
      ['subtree_end', i32([2, 2])],
      ['seq_offsets', i32([0, 2])],
      ['seq_positions', i32([0, 1])],
      ['loss_mask', { dtype: 'U8' as const, shape: [2], data: Uint8Array.from([0, 1]) }],
    ]);
    const metadata: Record<string, string> = {
      format: 'treepack/1',
      num_sequences: '1',
      num_tokens_naive: '2',
      num_tokens_packed: '2',
      tokenizer: 't',
      sequence_ids: '["a"]',
    };
    const path = join(dir, 'mb.safetensors');
    writeSafetensors(path, tensors, metadata);
    expect(readMicroBatch(path).batch.input_ids).toEqual(Int32Array.from([5, 6]));
    const refused = (t: Map<string, unknown>, m: Record<string, string>) => {
      writeSafetensors(path, t as typeof tensors, m);
      return (caught(() => readMicroBatch(path)) as TreepackError | undefined)?.code === 'E_INPUT';
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
    const err = caught(() => readManifest(dir)) as TreepackError | undefined;
    expect(err?.code).toBe('E_INPUT');
    expect(err?.message).toContain('format is "treepack/2", expected "treepack/1"');
    expect(format.replace(/\s+/g, ' ')).toContain('"format is "treepack/2", expected "treepack/1""');
  });
});

type Operation = { responses: Record<string, { $ref?: string; content?: Record<string, { schema: { $ref?: string } }> }> };
interface OpenApi {
  openapi: string;
  paths: Record<string, Record<string, Operation>>;
  components: {
    responses: Record<string, { content?: Record<string, { schema: { $ref?: string } }> }>;
    schemas: { Error: { properties: { error: { properties: { type: { enum: string[] } } } } } };
  };
}

describe('openapi.json and http.md', () => {
  const spec = JSON.parse(page('openapi.json')) as OpenApi;
  let svc: Service | undefined;
  const token = 'reference-docs-token';
  const auth = { authorization: `Bearer ${token}` };

  beforeAll(async () => {
    // Port 9 (discard) on loopback: nothing listens, so a gateway call fails as an unreachable engine does (502).
    svc = await Service.create({
      packer: { tokenizer: 'qwen3' },
      engineUrl: 'http://127.0.0.1:9/v1',
      dataDir: mkdtempSync(join(tmpdir(), 'tp-refdocs-serve-')),
      port: 0,
      token,
      engineTimeoutMs: 2000,
    });
    await svc.app.ready();
  }, 60_000);
  afterAll(async () => {
    await svc?.close();
  });

  /** `METHOD /path/{param}` of every route the service registered (HEAD, which Fastify adds to each GET, left out). */
  function registeredRoutes(): string[] {
    const routes: string[] = [];
    const stack: { depth: number; path: string }[] = [];
    for (const line of svc!.app.printRoutes({ commonPrefix: false }).split('\n')) {
      const m = /^([│ ]*)[├└]── (\S+)(?: \(([A-Z, ]+)\))?/.exec(line);
      if (!m) continue;
      const depth = m[1].length;
      while (stack.length && stack[stack.length - 1].depth >= depth) stack.pop();
      const path = (stack.length ? stack[stack.length - 1].path : '') + m[2];
      stack.push({ depth, path });
      for (const method of (m[3] ?? '').split(', ').filter((x) => x && x !== 'HEAD'))
        routes.push(`${method} ${path.replace(/:(\w+)/g, '{$1}')}`);
    }
    return routes.sort();
  }

  const documentedRoutes = () =>
    Object.entries(spec.paths)
      .flatMap(([path, ops]) => Object.keys(ops).map((m) => `${m.toUpperCase()} ${path}`))
      .sort();

  it('is OpenAPI 3.1 and documents exactly the routes the service registers', () => {
    expect(spec.openapi).toBe('3.1.0');
    const registered = registeredRoutes();
    expect(registered.length).toBeGreaterThan(20); // the listing was read, not an empty parse
    expect(registered).toContain('POST /v1/batches/{id}/ack');
    // A route registered and not in openapi.json (or the reverse) shows here by name.
    expect(documentedRoutes()).toEqual(registered);
  });

  it('http.md names every route of openapi.json', () => {
    const http = page('http.md');
    for (const route of documentedRoutes()) expect(http, route).toContain('`' + route + '`');
  });

  /** The schema of `status` for METHOD path in the spec, or undefined where that status is not documented there. */
  function documentedSchema(method: string, path: string, status: number): string | undefined {
    const responses = spec.paths[path]?.[method.toLowerCase()]?.responses;
    let r = responses?.[String(status)];
    if (r?.$ref) r = spec.components.responses[r.$ref.split('/').pop()!];
    return r?.content?.['application/json']?.schema.$ref;
  }

  const errorCases: [string, string, string, number, unknown?, Record<string, string>?][] = [
    ['an unknown episode', 'GET', '/v1/episodes/{id}', 404],
    ['a rank out of range', 'GET', '/v1/batches/next', 400],
    ['an unknown micro-batch', 'POST', '/v1/batches/{id}/ack', 404],
    ['a finish without a reward', 'POST', '/v1/episodes/{id}/finish', 400, { metadata: {} }],
    ['an episode key with a bad field', 'POST', '/v1/episodes', 400, { agent: 7 }],
    ['a chat call without messages', 'POST', '/v1/chat/completions', 400, { model: 'm' }, { 'x-treepack-episode': 'e1' }],
    [
      'a chat call the engine cannot answer',
      'POST',
      '/v1/chat/completions',
      502,
      { messages: [{ role: 'user', content: 'hi' }] },
      { 'x-treepack-episode': 'e2' },
    ],
    ['slime start without a group size', 'POST', '/start_rollout', 400, { task_type: 'math' }],
    ['a group never seen', 'POST', '/v1/groups/{id}/abandon', 404],
    ['no bearer token', 'GET', '/metrics', 401],
  ];
  const url = (path: string, status: number) =>
    path === '/v1/batches/next' ? `${path}?rank=99` : path.replace('{id}', status === 404 ? 'nope' : 'e9');

  for (const [what, method, path, status, payload, headers] of errorCases) {
    it(`${what}: ${method} ${path} answers ${status} in the documented error shape`, async () => {
      const res = await svc!.app.inject({
        method: method as 'GET',
        url: url(path, status),
        headers: { ...(status === 401 ? {} : auth), ...headers },
        payload: payload as object,
      });
      expect(res.statusCode, res.body).toBe(status);
      expect(documentedSchema(method, path, status), `${status} of ${method} ${path} in openapi.json`).toBe('#/components/schemas/Error');
      const body = res.json<{ error: Record<string, unknown> }>();
      expect(Object.keys(body)).toEqual(['error']);
      expect(Object.keys(body.error).sort()).toEqual(['code', 'message', 'type']);
      expect(typeof body.error.message).toBe('string');
      expect(spec.components.schemas.Error.properties.error.properties.type.enum).toContain(body.error.type);
      expect(body.error.code === null || typeof body.error.code === 'string').toBe(true);
    });
  }

  it('an unknown route answers 404 in the error shape, with code not_found', async () => {
    const res = await svc!.app.inject({ method: 'POST', url: '/v1/nope', headers: auth });
    expect(res.statusCode).toBe(404);
    expect(res.json()).toEqual({ error: { message: 'no route POST /v1/nope', type: 'invalid_request_error', code: 'not_found' } });
  });
});

/** Every file under `dir`, relative to it, sorted. */
const tree = (dir: string) =>
  readdirSync(dir, { recursive: true, withFileTypes: true })
    .filter((e) => e.isFile())
    .map((e) => relative(dir, join(e.parentPath, e.name)))
    .sort();

describe('the TypeScript API reference (docs/reference/typescript, npm run docs:ts)', () => {
  it('every export of treepack, treepack/ops and treepack/serve has a doc comment', { timeout: 120_000 }, () => {
    expect(undocumentedExports()).toEqual([]);
  });

  it('is what TypeDoc generates from the sources now, without a warning', { timeout: 300_000 }, (ctx) => {
    let typedoc: string;
    try {
      typedoc = join(dirname(createRequire(import.meta.url).resolve('typedoc/package.json')), 'bin/typedoc');
    } catch {
      return ctx.skip('typedoc is not installed (a devDependency of package.json: run npm install)');
    }
    const out = mkdtempSync(join(tmpdir(), 'tp-typedoc-'));
    const r = spawnSync(process.execPath, [typedoc, '--options', 'typedoc.json', '--out', out, '--treatWarningsAsErrors'], {
      cwd: root,
      encoding: 'utf8',
      timeout: 280_000,
    });
    expect(r.status, r.stdout + r.stderr).toBe(0);
    const checkedIn = join(root, 'docs/reference/typescript');
    expect(tree(checkedIn), 'run npm run docs:ts').toEqual(tree(out));
    for (const f of tree(out))
      expect(readFileSync(join(checkedIn, f), 'utf8'), `${f}: run npm run docs:ts`).toBe(readFileSync(join(out, f), 'utf8'));
  });
});

describe('backends.md', () => {
  const backendsPage = page('backends.md');

  it('its ops table is the kernels each backend registers, in the order auto tries them', { timeout: 120_000 }, async () => {
    const rows = tableRows(section(backendsPage, 'Ops per backend'));
    const header = backendsPage.split('\n').find((l) => l.startsWith('| op |'))!;
    const columns = header
      .slice(1, -1)
      .split('|')
      .map((c) => c.trim().replace(/`/g, ''))
      .slice(1);
    try {
      const statuses = await listBackends();
      expect(statuses.map((s) => s.name)).toEqual(columns);
      expect([...BACKEND_NAMES]).toEqual(columns);
      for (const [i, name] of columns.entries()) {
        const documented = rows.filter((r) => r[i + 1] === 'yes').map((r) => r[0].replace(/`/g, ''));
        expect(documented.sort(), name).toEqual([...statuses[i].ops].sort());
      }
    } finally {
      await disposeBackends();
    }
  });

  it('lists every TREEPACK_* environment variable the code, the scripts and the tests read, and no other', () => {
    const files = ['src', 'scripts', 'python', 'test', 'bench', '.ci'].flatMap((d) =>
      sources(d, '').filter((f) => /\.(ts|mts|mjs|js|py|sh)$|\/run$/.test(f)),
    );
    const read = new Set<string>();
    for (const f of files) {
      if (f === fileURLToPath(import.meta.url)) continue;
      for (const m of readFileSync(f, 'utf8').matchAll(/(-D)?(TREEPACK_[A-Z_]*[A-Z])/g)) {
        // C include guards (TREEPACK_ABI_H, written by gen-abi), the prefix as prose ("TREEPACK_REQUIRE_*") and CMake
        // options given on a command line (-DTREEPACK_CUDA=OFF, CMakeLists.txt) are no variables.
        if (!m[1] && !m[2].endsWith('_H') && m[2] !== 'TREEPACK_REQUIRE') read.add(m[2]);
      }
    }
    const documented = new Set(tableRows(section(backendsPage, 'Environment variables')).map((r) => /^`(TREEPACK_[A-Z_]+)/.exec(r[0])![1]));
    expect([...documented].sort()).toEqual([...read].sort());
  });
});
