/** What `fn` threw, or undefined: lets a test assert on the error object itself (code, where), not just its text. */
export function caught(fn: () => unknown): unknown {
  try {
    fn();
  } catch (err) {
    return err;
  }
  return undefined;
}
