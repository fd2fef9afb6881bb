import { createRequire } from 'node:module';

/** The package version, read from package.json so it cannot drift (two levels up from src/ or dist/src/). */
function packageVersion(): string {
  const require = createRequire(import.meta.url);
  for (const p of ['../package.json', '../../package.json']) {
    try {
      const pkg = require(p) as { name?: string; version?: string };
      if (pkg.name === 'treepack' && pkg.version) return pkg.version;
    } catch {
      // not at this depth
    }
  }
  return '0.0.0';
}

/** The package version (package.json's). */
export const VERSION = packageVersion();
