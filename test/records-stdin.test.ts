/** readRecords('-') reads the process's stdin: run in a child process fed through its stdin (the readers: test/records.test.ts). */
import { spawnSync } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { expect, it } from 'vitest';

it('reads stdin when the input is "-"', () => {
  const read = fileURLToPath(new URL('../src/records/read.ts', import.meta.url));
  const script = `import { readRecords } from ${JSON.stringify(read)};
    const ids = []; for await (const r of readRecords('-')) ids.push(r.id + ':' + r.tokens.length);
    console.log(JSON.stringify(ids));`;
  const res = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', script], {
    input: '{"tokens": [1, 2, 3]}\n\n{"id": "b", "tokens": [4]}\n',
    encoding: 'utf8',
    cwd: fileURLToPath(new URL('..', import.meta.url)),
  });
  expect(res.stderr).toBe('');
  expect(JSON.parse(res.stdout)).toEqual(['line-1:3', 'b:1']);
});
