// The project's linters and formatters, each on its own part of the tree:
//
//   node scripts/lint.mjs lint     npm run lint: eslint (TypeScript, JavaScript), ruff check (all Python), mypy (python/treepack)
//   node scripts/lint.mjs check    npm run format:check: prettier --check, ruff format --check, clang-format --dry-run (native/)
//   node scripts/lint.mjs format   npm run format: the same formatters, writing their changes
//
// eslint and prettier are devDependencies; ruff, mypy and clang-format are pinned in python/requirements-dev.txt and
// run from .venv-lint (scripts/python-env.mjs, lintEnv). Every step runs and says how long it took; the exit status
// is non-zero when any failed. mypy checks against the installed torch, numpy and transformers of the project's Python
// (pythonEnv): without them it is skipped with the reason, or fails under TREEPACK_REQUIRE_TORCH=1.
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { lintEnv, pythonEnv } from './python-env.mjs';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const mode = process.argv[2];
if (!['lint', 'check', 'format'].includes(mode)) {
  console.error('usage: node scripts/lint.mjs lint|check|format');
  process.exit(2);
}
const nodeBin = (name) => path.join(root, 'node_modules', '.bin', name);
const failed = [];

function run(name, cmd, args, opts = {}) {
  const t0 = Date.now();
  const r = spawnSync(cmd, args, { cwd: root, stdio: 'inherit', ...opts });
  const took = ((Date.now() - t0) / 1000).toFixed(1);
  const ok = r.status === 0;
  console.error(`${ok ? 'ok  ' : 'FAIL'} ${name} (${took} s)${r.error ? `: ${r.error.message}` : ''}`);
  if (!ok) failed.push(name);
}

/** native/'s C++ and CUDA sources (native/.clang-format-ignore leaves out the generated abi.h). */
function nativeSources() {
  const out = [];
  const walk = (dir) => {
    for (const e of fs.readdirSync(path.join(root, dir), { withFileTypes: true })) {
      const rel = path.join(dir, e.name);
      if (e.isDirectory()) walk(rel);
      else if (/\.(cc|h|cu|cuh)$/.test(e.name)) out.push(rel);
    }
  };
  walk('native');
  return out.sort();
}

const tools = lintEnv();
/** [.venv-lint's Python, its arguments] that run `module` with `args` (clang-format's package has no __main__). */
function py(module, args) {
  const main = module === 'clang_format' ? ['-c', 'import clang_format; clang_format.clang_format()'] : ['-m', module];
  return [tools.python, [...main, ...args]];
}
const needTools = (name) => {
  if (tools.python) return true;
  console.error(`FAIL ${name}: ${tools.reason}`);
  failed.push(name);
  return false;
};

if (mode === 'lint') {
  run('eslint', nodeBin('eslint'), ['--max-warnings', '0', '.']);
  if (needTools('ruff check')) run('ruff check', ...py('ruff', ['check', '.']));
  if (needTools('mypy')) {
    const env = pythonEnv();
    if (env.torch) run('mypy', ...py('mypy', ['--python-executable', env.python]), { cwd: path.join(root, 'python') });
    else if (process.env.TREEPACK_REQUIRE_TORCH === '1') {
      console.error(`FAIL mypy: ${env.reason} (TREEPACK_REQUIRE_TORCH=1)`);
      failed.push('mypy');
    } else console.error(`skip mypy: it checks against torch, numpy and transformers, and ${env.reason}`);
  }
} else {
  const write = mode === 'format';
  run('prettier', nodeBin('prettier'), [write ? '--write' : '--check', '--log-level', 'warn', '.']);
  if (needTools('ruff format')) run('ruff format', ...py('ruff', ['format', ...(write ? [] : ['--check']), '.']));
  if (needTools('clang-format')) {
    run('clang-format', ...py('clang_format', [...(write ? ['-i'] : ['--dry-run', '-Werror']), ...nativeSources()]));
  }
}
if (failed.length) {
  console.error(`${mode}: ${failed.join(', ')} failed${mode === 'check' ? ' (npm run format applies every formatter)' : ''}`);
  process.exitCode = 1;
}
