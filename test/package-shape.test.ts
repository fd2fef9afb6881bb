/**
 * The package's entry points (package.json "exports") and what each loads: the root `treepack` is the packer and
 * loads none of the service's dependencies, which only `treepack/serve` brings in. Each entry is imported by name
 * in a fresh Node process whose resolve hook records every module it loads (the built dist/, as users get it).
 * The service's packages are optional peers: the CLI packs with them absent (a hook that refuses to resolve them,
 * as Node does when they are not installed) and `treepack serve` then names what to install.
 */
import { spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { pathToFileURL } from 'node:url';
import { afterAll, describe, expect, it } from 'vitest';
import { generateJsonl } from '../bench/dataset.js';
import { SERVICE_PACKAGES } from '../src/serve/load.js';

const root = resolve(__dirname, '..');
const dir = mkdtempSync(join(tmpdir(), 'treepack-shape-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const hook = join(dir, 'hook.mjs');
writeFileSync(
  hook,
  "export async function resolve(spec, ctx, next) { const r = await next(spec, ctx); process.stderr.write('LOADED ' + r.url + '\\n'); return r; }\n",
);
const register = join(dir, 'register.mjs');
writeFileSync(register, `import { register } from 'node:module'; register(${JSON.stringify(pathToFileURL(hook).href)});\n`);

/** The npm packages (by name) that importing `entry` loads, and the entry's exported names. */
function loads(entry: string): { packages: string[]; exports: string[] } {
  const code = `const m = await import(${JSON.stringify(entry)}); console.log(JSON.stringify(Object.keys(m)));`;
  const r = spawnSync(process.execPath, ['--import', register, '--input-type=module', '-e', code], { cwd: root, encoding: 'utf8' });
  expect(r.status, r.stderr).toBe(0);
  const packages = new Set<string>();
  for (const m of r.stderr.matchAll(/^LOADED .*\/node_modules\/((?:@[^/]+\/)?[^/]+)\//gm)) packages.add(m[1]);
  return { packages: [...packages].sort(), exports: JSON.parse(r.stdout.trim().split('\n').pop()!) };
}

const SERVICE_DEPENDENCIES: string[] = [...SERVICE_PACKAGES];

describe('package entry points', () => {
  it('treepack: the packer, without the service or its dependencies', () => {
    const { packages, exports } = loads('treepack');
    expect(packages.filter((p) => SERVICE_DEPENDENCIES.includes(p) || p === 'webgpu')).toEqual([]);
    expect(exports).toEqual(expect.arrayContaining(['packRecords', 'createPacker', 'DirectorySink', 'readMicroBatch', 'TreepackError']));
    expect(exports).not.toContain('Service');
    expect(exports).not.toContain('resolveKernel');
  });

  it('treepack/ops: the kernels one at a time, without the service', () => {
    const { packages, exports } = loads('treepack/ops');
    expect(packages.filter((p) => SERVICE_DEPENDENCIES.includes(p))).toEqual([]);
    expect(exports).toEqual(expect.arrayContaining(['listBackends', 'resolveKernel', 'computeLoss', 'configureBackends']));
  });

  it('treepack/serve: the service and its dependencies (the hook sees what an import loads)', () => {
    const { packages, exports } = loads('treepack/serve');
    expect(packages).toEqual(expect.arrayContaining(SERVICE_DEPENDENCIES));
    expect(exports.sort()).toEqual(['Service', 'startService']);
  });
});

/** A hook that answers as Node does where the service's packages are not installed. */
const absent = join(dir, 'absent.mjs');
writeFileSync(
  absent,
  `const absent = new Set(${JSON.stringify(SERVICE_PACKAGES)});
export async function resolve(spec, ctx, next) {
  const name = spec.split('/').slice(0, spec.startsWith('@') ? 2 : 1).join('/');
  if (absent.has(name)) throw Object.assign(new Error("Cannot find package '" + spec + "'"), { code: 'ERR_MODULE_NOT_FOUND' });
  const r = await next(spec, ctx);
  process.stderr.write('LOADED ' + r.url + '\\n');
  return r;
}
`,
);
const registerAbsent = join(dir, 'register-absent.mjs');
writeFileSync(registerAbsent, `import { register } from 'node:module'; register(${JSON.stringify(pathToFileURL(absent).href)});\n`);

/** The CLI (dist/) run with the service's packages absent. */
function cliWithout(args: string[]) {
  const r = spawnSync(process.execPath, ['--import', registerAbsent, join(root, 'dist/src/cli/main.js'), ...args], {
    cwd: dir,
    encoding: 'utf8',
    timeout: 120_000,
  });
  const packages = new Set<string>();
  for (const m of r.stderr.matchAll(/^LOADED .*\/node_modules\/((?:@[^/]+\/)?[^/]+)\//gm)) packages.add(m[1]);
  return { status: r.status, stdout: r.stdout, stderr: r.stderr.replace(/^LOADED .*\n/gm, ''), packages: [...packages] };
}

describe('the service as an optional part', () => {
  it('its packages are optional peers (installed for this checkout as devDependencies), not dependencies', () => {
    const pkg = JSON.parse(readFileSync(join(root, 'package.json'), 'utf8')) as Record<string, Record<string, unknown>>;
    expect(Object.keys(pkg.peerDependencies).sort()).toEqual([...SERVICE_PACKAGES].sort());
    for (const name of SERVICE_PACKAGES) {
      expect(pkg.peerDependenciesMeta[name], name).toEqual({ optional: true });
      expect(pkg.devDependencies[name], name).toBe(pkg.peerDependencies[name]);
      expect(pkg.dependencies[name], name).toBeUndefined();
      expect(pkg.optionalDependencies?.[name], name).toBeUndefined();
    }
  });

  it('treepack pack and stats run without them; treepack serve names what to install', { timeout: 180_000 }, () => {
    const input = join(dir, 'rollouts.jsonl');
    writeFileSync(input, generateJsonl({ groups: 2, episodesPerGroup: 2, minTurns: 2, maxTurns: 3 }));
    const pack = cliWithout(['pack', input, '--out', join(dir, 'packed'), '--tokenizer', 'qwen3']);
    expect(pack.status, pack.stderr).toBe(0);
    expect(existsSync(join(dir, 'packed', 'manifest.json'))).toBe(true);
    expect(pack.packages.filter((p) => SERVICE_DEPENDENCIES.includes(p))).toEqual([]);
    const stats = cliWithout(['stats', input, '--tokenizer', 'qwen3']);
    expect(stats.status, stats.stderr).toBe(0);
    const serve = cliWithout(['serve', '--engine', 'http://127.0.0.1:9/v1', '--data', join(dir, 'serve'), '--tokenizer', 'qwen3']);
    expect(serve.status).toBe(1);
    expect(serve.stderr).toContain(
      `treepack serve needs packages the packer does not install (missing: ${SERVICE_PACKAGES.join(', ')}): npm install ${SERVICE_PACKAGES.join(' ')}`,
    );
    expect(existsSync(join(dir, 'serve'))).toBe(false); // refused before anything was written
  });
});
