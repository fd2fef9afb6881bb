/**
 * The package's entry points (package.json "exports") and what each loads: the root `treepack` is the packer and
 * loads none of the service's dependencies, which only `treepack/serve` brings in. Each entry is imported by name
 * in a fresh Node process whose resolve hook records every module it loads (the built dist/, as users get it).
 */
import { spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { pathToFileURL } from 'node:url';
import { afterAll, describe, expect, it } from 'vitest';

const root = resolve(__dirname, '..');
const dir = mkdtempSync(join(tmpdir(), 'treepack-shape-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const hook = join(dir, 'hook.mjs');
writeFileSync(hook, "export async function resolve(spec, ctx, next) { const r = await next(spec, ctx); process.stderr.write('LOADED ' + r.url + '\\n'); return r; }\n");
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

const SERVICE_DEPENDENCIES = ['fastify', '@fastify/rate-limit', 'ioredis', 'prom-client', 'eventsource-parser'];

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
