/**
 * Data flows one way through src/: no module imports, directly or through others, a module that imports it.
 * The graph counts every import the TypeScript compiler sees (type-only imports, `export ... from` and dynamic
 * `import()` included): a route that imports `type Service` from the service that registers it is a cycle in the
 * design even where it erases at run time.
 */
import { readdirSync, readFileSync } from 'node:fs';
import { join, relative, resolve } from 'node:path';
import ts from 'typescript';
import { describe, expect, it } from 'vitest';
import { cycles, importsOf } from './helpers/graph.js';

const ROOT = resolve(import.meta.dirname, '..');

function sources(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((d) => {
    const p = join(dir, d.name);
    if (d.isDirectory()) return sources(p);
    return d.name.endsWith('.ts') && !d.name.endsWith('.d.ts') ? [p] : [];
  });
}

/** Each source file's imports of other files in the same set, resolved as `tsc -p tsconfig.json` resolves them. */
function importGraph(files: string[]): Map<string, string[]> {
  const config = ts.getParsedCommandLineOfConfigFile(join(ROOT, 'tsconfig.json'), {}, { ...ts.sys, onUnRecoverableConfigFileDiagnostic: (d) => { throw new Error(ts.flattenDiagnosticMessageText(d.messageText, '\n')); } });
  const options = config!.options;
  const inSet = new Set(files);
  const graph = new Map<string, string[]>();
  for (const file of files) {
    const deps = importsOf(readFileSync(file, 'utf8'))
      .map((spec) => ts.resolveModuleName(spec, file, options, ts.sys).resolvedModule?.resolvedFileName)
      .filter((p): p is string => p !== undefined && inSet.has(resolve(p)))
      .map((p) => resolve(p));
    graph.set(file, [...new Set(deps)]);
  }
  return graph;
}

describe('import graph of src/', () => {
  it('finds a cycle where there is one (negative control)', () => {
    const g = new Map([
      ['a', ['b']],
      ['b', ['c']],
      ['c', ['a', 'd']],
      ['d', []],
      ['e', ['e']],
    ]);
    expect(cycles(g)).toEqual([['a', 'b', 'c'], ['e']]);
    expect(cycles(new Map([['a', ['b']], ['b', []]]))).toEqual([]);
  });

  it('has no import cycles', () => {
    const files = sources(join(ROOT, 'src')).map((f) => resolve(f));
    const graph = importGraph(files);
    // the walk sees the imports: the service registers its routes
    expect(graph.get(join(ROOT, 'src/serve/service.ts'))).toContain(join(ROOT, 'src/serve/gateway.ts'));
    const found = cycles(graph).map((c) => c.map((f) => relative(ROOT, f)));
    expect(found, `import cycles:\n${found.map((c) => c.join(' <-> ')).join('\n')}`).toEqual([]);
  });
});
