/**
 * The common prefix of any two sorted sequences from the adjacent LCP array (sortSequences): for sorted
 * positions a < b it is min(lcp[a+1..b]), answered in O(1) from a sparse table (S·log S entries).
 */
export type LcpQuery = (a: number, b: number) => number;

/** Longest common prefix of sorted sequences a and b in O(1), from the LCP array of adjacent ones (a sparse table). */
export function lcpQuery(lcp: Int32Array): LcpQuery {
  const S = lcp.length;
  const table: Int32Array[] = [lcp];
  for (let w = 1; 2 * w <= S; w *= 2) {
    const prev = table[table.length - 1],
      next = new Int32Array(S);
    for (let i = 0; i + 2 * w <= S; i++) next[i] = Math.min(prev[i], prev[i + w]);
    table.push(next);
  }
  return (a, b) => {
    const lo = a + 1,
      k = 31 - Math.clz32(b - lo + 1);
    return Math.min(table[k][lo], table[k][b - (1 << k) + 1]);
  };
}
