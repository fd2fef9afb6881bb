/** Number wording shared by the bench's sections: ratios read the right way round ("1.8× slower", never "0.6× faster"). */

export const fmt = (x: number, d = 2) => x.toFixed(d);

export const big = (x: number) =>
  x >= 1e9 ? `${fmt(x / 1e9)}G` : x >= 1e6 ? `${fmt(x / 1e6)}M` : x >= 1e3 ? `${fmt(x / 1e3, 1)}k` : String(Math.round(x));

/** `baseline ÷ value` of a time, in words: "3.10× faster" or "1.80× slower" (than the baseline). */
export function speed(baselineSeconds: number, seconds: number): string {
  const r = baselineSeconds / seconds;
  return r >= 1 ? `${fmt(r)}× faster` : `${fmt(1 / r)}× slower`;
}

/** `value ÷ baseline` of a size, in words: "2.50× more" or "4.00× less". */
export function amount(baseline: number, value: number, more = 'more', less = 'less'): string {
  const r = value / baseline;
  return r >= 1 ? `${fmt(r)}× ${more}` : `${fmt(1 / r)}× ${less}`;
}

export const mib = (bytes: number) => `${fmt(bytes / 2 ** 20, 0)} MiB`;
