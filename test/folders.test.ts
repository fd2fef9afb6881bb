/**
 * Data flows one way: no folder of src/ imports, directly or through others, a folder that imports it back. The
 * imports (static, re-exports, type-only and dynamic) of every src/ file are read as the compiler reads them; each
 * top-level folder is one node, each file at the top of src/ its own node. The bench is a user of the library: its files import src/ only
 * through the public entry points (package.json "exports": src/index.ts, src/ops.ts, src/serve/index.ts).
 */
import { readdirSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { cycles, importsOf } from './helpers/graph.js';

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const SRC = path.join(ROOT, 'src');
const BENCH = path.join(ROOT, 'bench');

function files(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((e) =>
    e.isDirectory() ? files(path.join(dir, e.name)) : e.name.endsWith('.ts') ? [path.join(dir, e.name)] : [],
  );
}

/** Relative specifiers: the files of this checkout an import names. */
const relativeImportsOf = (source: string): string[] => importsOf(source).filter((spec) => spec.startsWith('.'));

function nodeOf(file: string): string {
  const rel = path.relative(SRC, file).split(path.sep);
  return rel.length === 1 ? rel[0] : rel[0] + '/';
}

/** Folder edges, each with one file:specifier that makes it. */
function folderGraph(): Map<string, Map<string, string>> {
  const graph = new Map<string, Map<string, string>>();
  for (const file of files(SRC)) {
    const from = nodeOf(file);
    for (const spec of relativeImportsOf(readFileSync(file, 'utf8'))) {
      const to = nodeOf(path.resolve(path.dirname(file), spec).replace(/\.js$/, '.ts'));
      if (to === from) continue;
      if (!graph.has(from)) graph.set(from, new Map());
      if (!graph.get(from)!.has(to)) graph.get(from)!.set(to, `${path.relative(SRC, file)} imports ${spec}`);
    }
  }
  return graph;
}

/** The folder graph's edges without the import that gives each (what helpers/graph.ts's cycles read). */
const edges = (graph: Map<string, Map<string, string>>) => new Map([...graph].map(([k, v]) => [k, [...v.keys()]]));

describe('folder dependencies of src/', () => {
  it('finds every kind of import, and a cycle where there is one', () => {
    expect(
      relativeImportsOf(
        `import a from './a.js';\nimport type { B } from '../b/x.js';\nexport * from './c.js';\nexport { d } from "../d/y.js";\nimport './e.js';\nconst f = await import('../f/z.js');\nimport fs from 'node:fs';`,
      ),
    ).toEqual(['./a.js', '../b/x.js', './c.js', '../d/y.js', './e.js', '../f/z.js']);
    const g = new Map([
      ['a/', new Map([['b/', '']])],
      ['b/', new Map([['c/', '']])],
      ['c/', new Map([['a/', '']])],
      ['d/', new Map([['a/', '']])],
    ]);
    expect(cycles(edges(g))).toEqual([['a/', 'b/', 'c/']]);
  });

  it('has no cycle between folders', () => {
    const graph = folderGraph();
    expect(graph.size).toBeGreaterThan(5);
    const problems = cycles(edges(graph)).map((scc) => {
      const edges = scc.flatMap((a) => scc.filter((b) => graph.get(a)?.has(b)).map((b) => `  ${a} → ${b} (${graph.get(a)!.get(b)})`));
      return `cycle between ${scc.join(', ')}:\n${edges.join('\n')}`;
    });
    expect(problems.join('\n')).toBe('');
  });
});

/** The source of each entry point of package.json "exports" (dist/src/x.js ← src/x.ts). */
const ENTRY_POINTS = Object.values(
  JSON.parse(readFileSync(path.join(ROOT, 'package.json'), 'utf8')).exports as Record<string, string | { import: string }>,
).flatMap((e) => (typeof e === 'string' ? [] : [e.import.replace(/^\.\/dist\//, '').replace(/\.js$/, '')]));

/** Why bench file `file` may not import `spec`, or undefined: only the entry points, bench siblings and test helpers. */
function benchImportProblem(file: string, spec: string): string | undefined {
  const target = path
    .relative(ROOT, path.resolve(path.dirname(file), spec))
    .split(path.sep)
    .join('/');
  if (ENTRY_POINTS.includes(target.replace(/\.(js|ts)$/, ''))) return undefined;
  if (target.startsWith('src/'))
    return `${path.basename(file)} imports ${spec}: an internal module (a user imports an entry point: ${ENTRY_POINTS.join(', ')})`;
  if (/^(bench|test\/helpers)\/[^/]+$/.test(target)) return undefined;
  return `${path.basename(file)} imports ${spec}: neither an entry point, a bench file nor a test helper`;
}

describe('imports of bench/', () => {
  it('tells the public API from internals', () => {
    const f = path.join(BENCH, 'x.ts');
    expect(ENTRY_POINTS).toEqual(['src/index', 'src/ops', 'src/serve/index']);
    for (const ok of ['../src/index.js', '../src/ops.js', '../src/serve/index.js', './format.js', '../test/helpers/sequences.js'])
      expect(benchImportProblem(f, ok)).toBeUndefined();
    expect(benchImportProblem(f, '../src/backend/native.js')).toMatch(/x\.ts imports \.\.\/src\/backend\/native\.js: an internal module/);
    expect(benchImportProblem(f, '../src/errors.js')).toMatch(/internal module/);
    expect(benchImportProblem(f, '../test/forest.test.js')).toMatch(/neither/);
  });

  it('use only the public API of src/', () => {
    const benchFiles = files(BENCH);
    expect(benchFiles.length).toBeGreaterThan(5);
    const problems = benchFiles.flatMap((file) =>
      relativeImportsOf(readFileSync(file, 'utf8')).flatMap((spec) => benchImportProblem(file, spec) ?? []),
    );
    expect(problems).toEqual([]);
  });
});
