/** Types of scripts/python-env.mjs (see there). */
export interface PythonEnv {
  /** The interpreter to run; null when no Python with numpy was found. */
  python: string | null;
  /** Whether it imports torch, transformers and numpy. */
  torch: boolean;
  /** Why torch is unavailable ('' when it is). */
  reason: string;
  /** 'TREEPACK_PYTHON', '.venv', 'PATH' or ''. */
  source: string;
}
export function pythonEnv(opts?: { create?: boolean }): PythonEnv;
export interface WheelEnv {
  /** The interpreter of the venv the wheel is installed in; null when it could not be built or installed. */
  python: string | null;
  /** The wheel file ('' when none). */
  wheel: string;
  /** Why not ('' when installed). */
  reason: string;
}
export function wheelEnv(python: string): WheelEnv;
/** .venv-fla, created if needed: its interpreter, or null and why not. */
export function flaEnv(): { python: string | null; reason: string };
/**
 * Creates a venv at `dir` (default .venv) with `base` and installs `requirements` into it (seeing `over`'s packages
 * behind its own, if given): '' when made, else what failed.
 */
export function createVenv(base: string, dir?: string, requirements?: string, over?: string | null): string;
/** .venv-oldest (the oldest supported transformers and TRL over `python`'s other packages), created if needed. */
export function oldestEnv(python: string): { python: string | null; reason: string };
/** .venv-lint (python/requirements-dev.txt), created if needed: its interpreter, or null and why not. */
export function lintEnv(): { python: string | null; reason: string };
