/** The Python with torch that the bench's trainer-side sections run: scripts/python-env.mjs finds it (TREEPACK_PYTHON,
 * the project .venv, PATH) or makes the project .venv once, and says why when it cannot. */
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

export const root = resolve(dirname(fileURLToPath(import.meta.url)), '..');

export interface PythonEnv {
  python: string | null;
  torch: boolean;
  reason: string;
  source: string;
}

export async function findPython(): Promise<PythonEnv> {
  const finder = pathToFileURL(join(root, 'scripts', 'python-env.mjs')).href;
  return import(finder)
    .then((m: { pythonEnv: () => PythonEnv }) => m.pythonEnv())
    .catch((e: Error) => ({ python: null, torch: false, reason: `scripts/python-env.mjs: ${e.message}`, source: '' }));
}
