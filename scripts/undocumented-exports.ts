/**
 * The exported names of the package's entry points (treepack, treepack/ops, treepack/serve) that have no doc
 * comment where they are declared: what the TypeScript API reference (`npm run docs:ts`, TypeDoc) would show bare.
 * Prints them and exits 1 when there are any; test/reference-docs.test.ts asserts there are none.
 */
import { fileURLToPath } from 'node:url';
import ts from 'typescript';

const root = fileURLToPath(new URL('..', import.meta.url));
export const ENTRY_POINTS = { treepack: 'src/index.ts', 'treepack/ops': 'src/ops.ts', 'treepack/serve': 'src/serve/index.ts' } as const;

/** `entry: name` of every export without a doc comment. */
export function undocumentedExports(): string[] {
  const config = ts.getParsedCommandLineOfConfigFile(
    `${root}tsconfig.json`,
    {},
    { ...ts.sys, onUnRecoverableConfigFileDiagnostic: () => {} },
  );
  if (!config) throw new Error('cannot read tsconfig.json');
  const files = Object.values(ENTRY_POINTS).map((f) => root + f);
  const program = ts.createProgram(files, { ...config.options, noEmit: true });
  const checker = program.getTypeChecker();
  const missing: string[] = [];
  for (const [entry, file] of Object.entries(ENTRY_POINTS)) {
    const source = program.getSourceFile(root + file);
    const moduleSymbol = source && checker.getSymbolAtLocation(source);
    if (!moduleSymbol) throw new Error(`${file}: not a module`);
    for (const exported of checker.getExportsOfModule(moduleSymbol)) {
      const symbol = exported.flags & ts.SymbolFlags.Alias ? checker.getAliasedSymbol(exported) : exported;
      const documented =
        symbol.getDocumentationComment(checker).length > 0 ||
        (symbol.declarations ?? []).some((d) => ts.getJSDocCommentsAndTags(d).length > 0);
      if (!documented) missing.push(`${entry}: ${exported.name}`);
    }
  }
  return missing;
}

if (process.argv[1] && fileURLToPath(import.meta.url) === process.argv[1]) {
  const missing = undocumentedExports();
  for (const m of missing) console.log(m);
  process.exitCode = missing.length ? 1 : 0;
}
