/**
 * Data flows one way through src/: no module imports, directly or through others, a module that imports it.
 * The graph counts every import the TypeScript compiler sees (type-only imports, `export ... from` and dynamic
 * `import()` included): a route that imports `type Service` from the service that registers it is a cycle in the
 * design even where it erases at run time. The same holds for the Python package python/treepack, where an import
 * inside a function (a lazy `__getattr__`) counts too.
 */
import { readdirSync, readFileSync } from 'node:fs';
import { dirname, join, relative, resolve } from 'node:path';
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
  const config = ts.getParsedCommandLineOfConfigFile(
    join(ROOT, 'tsconfig.json'),
    {},
    {
      ...ts.sys,
      onUnRecoverableConfigFileDiagnostic: (d) => {
        throw new Error(ts.flattenDiagnosticMessageText(d.messageText, '\n'));
      },
    },
  );
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
    expect(
      cycles(
        new Map([
          ['a', ['b']],
          ['b', []],
        ]),
      ),
    ).toEqual([]);
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

/** Every `.py` file under dir. */
function pythonSources(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((d) => {
    const p = join(dir, d.name);
    if (d.isDirectory()) return pythonSources(p);
    return d.name.endsWith('.py') ? [p] : [];
  });
}

/**
 * Each module's imports of modules of the package, wherever the import statement stands (top level, a function, a
 * TYPE_CHECKING block): `from .a import b` is an edge to a.b when that is a module, else to a (its __init__.py for a
 * package). Importing a submodule also runs its packages' __init__.py; those edges are left out, as Python allows them.
 */
export function pythonImportGraph(pkg: string): Map<string, string[]> {
  const files = pythonSources(pkg).map((f) => resolve(f));
  const top = dirname(pkg);
  const moduleFile = (parts: string[]): string | undefined => {
    const base = join(top, ...parts);
    for (const f of [base + '.py', join(base, '__init__.py')]) if (files.includes(f)) return f;
    return undefined;
  };
  const graph = new Map<string, string[]>();
  for (const file of files) {
    const text = readFileSync(file, 'utf8').replace(/\\\n/g, ' ');
    const here = relative(top, file).replace(/\.py$/, '').split('/');
    const pkgParts = here.slice(0, -1); // the package a relative import starts from, for a module and an __init__.py alike
    const deps: string[] = [];
    const add = (parts: string[], names: string[]) => {
      const found = names.map((n) => moduleFile([...parts, n])).filter((f): f is string => f !== undefined);
      if (found.length === names.length && names.length) deps.push(...found);
      else {
        const f = moduleFile(parts);
        if (f) deps.push(f, ...found);
      }
    };
    for (const m of text.matchAll(/^[ \t]*from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]+)/gm)) {
      const names = m[3]
        .replace(/[()]/g, ' ')
        .split(',')
        .map((n) => n.trim().split(/\s+/)[0])
        .filter(Boolean);
      const dotted = m[2] ? m[2].split('.') : [];
      if (m[1]) add([...pkgParts.slice(0, pkgParts.length - (m[1].length - 1)), ...dotted], names);
      else if (dotted[0] === here[0]) add(dotted, names);
    }
    for (const m of text.matchAll(/^[ \t]*import[ \t]+([^\n#]+)/gm)) {
      for (const name of m[1].split(',').map((n) => n.trim().split(/\s+/)[0])) {
        const f = name.split('.')[0] === here[0] ? moduleFile(name.split('.')) : undefined;
        if (f) deps.push(f);
      }
    }
    graph.set(
      file,
      [...new Set(deps)].filter((d) => d !== file),
    );
  }
  return graph;
}

describe('import graph of python/treepack', () => {
  it('has no import cycles', () => {
    const graph = pythonImportGraph(join(ROOT, 'python/treepack'));
    // the walk sees the imports, relative and absolute, in functions too
    expect(graph.get(join(ROOT, 'python/treepack/torch/loss.py'))).toContain(join(ROOT, 'python/treepack/loss.py'));
    expect(graph.get(join(ROOT, 'python/treepack/torch/__init__.py'))).toContain(join(ROOT, 'python/treepack/torch/loss.py'));
    const found = cycles(graph).map((c) => c.map((f) => relative(ROOT, f)));
    expect(found, `import cycles:\n${found.map((c) => c.join(' <-> ')).join('\n')}`).toEqual([]);
  });
});
