/** Reading the reference pages' tables in tests: the rows of the tables under one heading of a Markdown page. */

/** The lines of `page` under the heading `heading` (exact text after the #s), up to the next heading of its level or above. */
export function section(page: string, heading: string): string[] {
  const lines = page.split('\n');
  const at = lines.findIndex((l) => /^#+ /.test(l) && l.replace(/^#+ /, '') === heading);
  if (at < 0) throw new Error(`no heading "${heading}"`);
  const level = lines[at].indexOf(' ');
  const end = lines.findIndex((l, i) => i > at && /^#+ /.test(l) && l.indexOf(' ') <= level);
  return lines.slice(at + 1, end < 0 ? undefined : end);
}

/** The body rows of every table in `lines`, each as its cells (trimmed, `\|` kept as `|`). */
export function tableRows(lines: readonly string[]): string[][] {
  const rows: string[][] = [];
  for (let i = 0; i < lines.length; i++) {
    const l = lines[i];
    if (!l.startsWith('|') || /^\|(\s*:?-+:?\s*\|)+$/.test(l)) continue;
    if (/^\|(\s*:?-+:?\s*\|)+$/.test(lines[i + 1] ?? '')) continue; // a header row
    rows.push(
      l
        .slice(1, -1)
        .split(/(?<!\\)\|/)
        .map((c) => c.trim().replace(/\\\|/g, '|')),
    );
  }
  return rows;
}

/** The names in a table's first column: `name` in backticks, one per row. */
export function firstColumnNames(lines: readonly string[]): string[] {
  return tableRows(lines).map((r) => {
    const m = /^`([^`]+)`$/.exec(r[0]);
    if (!m) throw new Error(`first cell ${JSON.stringify(r[0])} is not one name in backticks`);
    return m[1];
  });
}
