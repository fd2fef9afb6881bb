/**
 * Chat records with images (src/records/images.ts, src/tokenize/images.ts, src/pack/images.ts): decoding, the
 * placeholder expansion, image identity in the forest on every backend, the image tensors of the micro-batch and
 * their file round trip, and bad inputs. test/images-python.test.ts checks the processor arithmetic against
 * transformers.
 */
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { resolveKernel } from '../src/backend/ops.js';
import { TreepackError } from '../src/errors.js';
import { readMicroBatch, writeMicroBatch } from '../src/io/microbatch.js';
import { toSequences } from '../src/pack/batch.js';
import type { MicroBatch } from '../src/pack/contract.js';
import { packForest } from '../src/pack/forest.js';
import { packRecords } from '../src/packer/pack-records.js';
import { decodeImage, ImageInputError } from '../src/records/images.js';
import { parseRecords } from '../src/records/read.js';
import type { Sample } from '../src/records/types.js';
import { ChatEncoder } from '../src/tokenize/chat.js';
import { ropeIndex, smartResize } from '../src/tokenize/images.js';
import { loadTokenizer } from '../src/tokenize/tokenizer.js';
import { writeImageWorkload } from '../bench/images.js';
import { describeBackends } from './helpers/backends.js';
import { cli } from './helpers/cli.js';
import { dataUrl, imagePart, jpg, png, vlTokenizerDir } from './helpers/images.js';

const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'treepack-images-'));
afterAll(() => fs.rmSync(tmp, { recursive: true, force: true }));
const TOK = vlTokenizerDir(path.join(tmp, 'vl'));
const IMAGE_PAD = 151655;

// Four screenshots: A and B have one size (equal placeholder runs), C another; A is also written as a file.
const A = png(56, 84, 1);
const B = png(56, 84, 2);
const C = png(112, 56, 3);
fs.writeFileSync(path.join(tmp, 'a.png'), A);

const user = (text: string, ...images: string[]) => ({ role: 'user', content: [...images.map(imagePart), { type: 'text', text }] });

/** An agent episode whose calls resend every earlier screenshot, plus a call with another image of A's size. */
function episode() {
  const m1 = [user('open the app', dataUrl(A))];
  const m2 = [...m1, { role: 'assistant', content: 'click(1)' }, user('now?', 'a.png')];
  const m3 = [...m2, { role: 'assistant', content: 'click(2)' }, user('and now?', dataUrl(C))];
  return [
    { id: 'e/0', episode: 'e', messages: m1, response: 'click(1)' },
    { id: 'e/1', episode: 'e', messages: m2, response: 'click(2)' },
    { id: 'e/2', episode: 'e', messages: m3, response: 'done' },
    { id: 'f/0', episode: 'f', messages: [user('open the app', dataUrl(B))], response: 'click(1)' },
    { id: 'g/0', episode: 'g', messages: [{ role: 'user', content: 'text only' }], response: 'ok' },
  ];
}

async function pack(lines: unknown[], opts: Record<string, unknown> = {}): Promise<MicroBatch[]> {
  const file = path.join(tmp, `in-${Math.random().toString(36).slice(2)}.jsonl`);
  fs.writeFileSync(file, lines.map((l) => JSON.stringify(l)).join('\n') + '\n');
  const out: MicroBatch[] = [];
  for await (const mb of packRecords(file, { tokenizer: TOK, backend: 'js', ...opts })) out.push(mb.batch);
  return out;
}

describe('image decoding', () => {
  it('drops alpha from PNG and keeps JPEG RGB, hashing the decoded bytes', () => {
    const img = decodeImage(A);
    expect([img.height, img.width, img.rgb.length]).toEqual([56, 84, 56 * 84 * 3]);
    const j = decodeImage(jpg(30, 40));
    expect([j.height, j.width, j.rgb.length]).toEqual([30, 40, 3600]);
    expect(decodeImage(A).sha256).toBe(img.sha256);
    expect(decodeImage(B).sha256).not.toBe(img.sha256);
  });

  it('refuses bytes that are not a PNG or JPEG', () => {
    expect(() => decodeImage(Buffer.from('GIF89a....'))).toThrow(ImageInputError);
    expect(() => decodeImage(A.subarray(0, 60))).toThrow(/undecodable image/);
  });
});

describe('smart_resize and rotary positions', () => {
  it('gives multiples of the factor within the pixel bounds', () => {
    for (const [h, w] of [
      [1, 1],
      [56, 84],
      [1000, 30],
      [4000, 3000],
      [27, 29],
    ]) {
      const [rh, rw] = smartResize(h, w, 28, 3136, 28 * 28 * 64);
      expect(rh % 28).toBe(0);
      expect(rw % 28).toBe(0);
      expect(rh * rw).toBeGreaterThanOrEqual(3136);
      expect(rh * rw).toBeLessThanOrEqual(28 * 28 * 64);
    }
  });

  it('places an image on its grid and continues text past its largest side', () => {
    const image = { grid: [1, 4, 6] } as never; // 2 × 3 merged patches
    const r = ropeIndex(10, [{ start: 2, image }], 2);
    // rows: temporal, height, width; text 0 1, image 2.., text from 2 + max(2, 3) = 5
    expect(Array.from(r.subarray(0, 10))).toEqual([0, 1, 2, 2, 2, 2, 2, 2, 5, 6]);
    expect(Array.from(r.subarray(10, 20))).toEqual([0, 1, 2, 2, 2, 3, 3, 3, 5, 6]);
    expect(Array.from(r.subarray(20, 30))).toEqual([0, 1, 2, 3, 4, 2, 3, 4, 5, 6]);
  });
});

describe('chat records with images', () => {
  it('expand each image into its placeholders, keyed by identity in the forest', async () => {
    const tok = await loadTokenizer(TOK);
    expect(tok.imageProcessor?.family).toBe('qwen2_5_vl');
    const enc = new ChatEncoder(tok);
    const recs = episode().flatMap((r, k) => parseRecords(r, { file: path.join(tmp, 'x.jsonl'), line: k + 1 }));
    const samples = recs.map((r) => enc.encode(r));
    const [s0, s1] = samples;
    // 56 × 84 → 56 × 84 under smart_resize (factor 28): 2 × 3 merged patches = 6 placeholders.
    expect(s0.images!.map((s) => s.image.tokens)).toEqual([6]);
    expect(Array.from(s0.tokens.subarray(s0.images![0].start - 1, s0.images![0].start + 7))).toEqual([
      151652,
      ...Array(6).fill(IMAGE_PAD),
      151653,
    ]);
    expect(s0.loss_mask.subarray(s0.images![0].start, s0.images![0].start + 6).every((x) => x === 0)).toBe(true);
    // The file path and the data URL are one image; B has A's size but is another image.
    expect(s1.images![1].image.hash).toBe(s0.images![0].image.hash);
    expect(samples[3].images![0].image.hash).not.toBe(s0.images![0].image.hash);
    expect(s1.images![1].image).toBe(s0.images![0].image); // resent images share one copy of their bytes
    // The forest of the keyed sequences has one node per distinct prefix, an image's placeholders told apart.
    const idOf = (s: Sample, t: number) => {
      const span = s.images?.find((x) => t >= x.start && t < x.start + x.image.tokens);
      return span ? `${span.image.hash}:${t - span.start}` : String(s.tokens[t]);
    };
    const prefixes = new Set<string>();
    for (const s of samples) {
      let key = '';
      for (let t = 0; t < s.tokens.length; t++) prefixes.add((key += idOf(s, t) + ','));
    }
    expect(packForest(toSequences(samples)).input_ids.length).toBe(prefixes.size);
    const plain = packForest({ tokens: Int32Array.from(samples.flatMap((s) => [...s.tokens])), offsets: toSequences(samples).offsets });
    expect(plain.input_ids.length).toBeLessThan(prefixes.size); // without identity, A and B would merge
  });

  it("find a VL model's template in its processor's chat_template.json", async () => {
    const dir = vlTokenizerDir(path.join(tmp, 'vl-processor-template'));
    const config = JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer_config.json'), 'utf8')) as Record<string, unknown>;
    fs.writeFileSync(path.join(dir, 'chat_template.json'), JSON.stringify({ chat_template: config.chat_template }));
    delete config.chat_template;
    fs.writeFileSync(path.join(dir, 'tokenizer_config.json'), JSON.stringify(config));
    const enc = new ChatEncoder(await loadTokenizer(dir));
    const [rec] = parseRecords(episode()[0], { file: path.join(tmp, 'x.jsonl'), line: 1 });
    expect(enc.encode(rec).images!.length).toBe(1);
  });

  it('write image tensors: each image once, fills on its nodes, 3-D positions per node', async () => {
    const batches = await pack(episode());
    expect(batches.length).toBe(1);
    const mb = batches[0];
    const N = mb.input_ids.length;
    const hashes = mb.meta.image_hashes!;
    expect(hashes.length).toBe(3); // A, B, C: each once, however often the calls resend it
    expect(mb.meta.image_processor).toMatchObject({ family: 'qwen2_5_vl', patch_size: 14, merge_size: 2, image_token_id: IMAGE_PAD });
    const sizes = Array.from(mb.image_sizes!);
    expect(mb.image_pixels!.length).toBe(hashes.reduce((n, _, i) => n + 3 * sizes[2 * i] * sizes[2 * i + 1], 0));
    // Every image placeholder node is covered by exactly one fill; fills cover nothing else.
    const cover = new Int32Array(N);
    const fills = mb.image_fills!;
    for (let k = 0; k < fills.length; k += 4) {
      const [img, pos, first, count] = fills.subarray(k, k + 4);
      const tokens = (mb.image_grid_thw![3 * img + 1] * mb.image_grid_thw![3 * img + 2]) / 4;
      expect(first + count).toBeLessThanOrEqual(tokens);
      for (let p = pos; p < pos + count; p++) cover[p]++;
    }
    for (let p = 0; p < N; p++) expect(cover[p]).toBe(mb.input_ids[p] === IMAGE_PAD ? 1 : 0);
    // A opens episode e (one fill, shared by its three calls) and is resent after "now?" (a second prefix, a
    // second fill, shared by e/1 and e/2); B and C fill once each.
    const perImage = new Map<number, number[]>();
    for (let k = 0; k < fills.length; k += 4) perImage.set(fills[k], [...(perImage.get(fills[k]) ?? []), fills[k + 3]]);
    expect([...perImage.values()].map((c) => c.join('+')).sort()).toEqual(['6', '6+6', '8']);
    // The pixels of each fill's image are the decoded bytes of the image the record named at that place.
    const offsets = [0];
    for (let i = 0; i < hashes.length; i++) offsets.push(offsets[i] + 3 * sizes[2 * i] * sizes[2 * i + 1]);
    const bytesOf = (i: number) => Buffer.from(mb.image_pixels!.subarray(offsets[i], offsets[i + 1]));
    const e0 = mb.meta.sequence_ids.indexOf('e/0'),
      f0 = mb.meta.sequence_ids.indexOf('f/0');
    const imageAt = (seq: number) => {
      const off = mb.seq_offsets[seq];
      for (let t = 0; ; t++) {
        const p = mb.seq_positions[off + t];
        if (mb.input_ids[p] !== IMAGE_PAD) continue;
        for (let k = 0; k < fills.length; k += 4) if (fills[k + 1] <= p && p < fills[k + 1] + fills[k + 3]) return fills[k];
      }
    };
    expect(bytesOf(imageAt(e0)).equals(Buffer.from(decodeImage(A).rgb))).toBe(true);
    expect(bytesOf(imageAt(f0)).equals(Buffer.from(decodeImage(B).rgb))).toBe(true);
    // Text-only sequences keep position = depth in all three rows; the positions are those of each sequence.
    const g0 = mb.meta.sequence_ids.indexOf('g/0');
    for (let t = 0; t < mb.seq_offsets[g0 + 1] - mb.seq_offsets[g0]; t++) {
      const p = mb.seq_positions[mb.seq_offsets[g0] + t];
      expect([0, 1, 2].map((d) => mb.mrope_position_ids![d * N + p])).toEqual([t, t, t]);
    }
    // The file round trip keeps every image tensor and header key.
    const file = path.join(tmp, 'mb.safetensors');
    writeMicroBatch(file, mb);
    const back = readMicroBatch(file).batch;
    for (const f of ['image_pixels', 'image_sizes', 'image_grid_thw', 'image_fills', 'mrope_position_ids', 'input_ids'] as const)
      expect(
        Buffer.from(back[f]!.buffer, back[f]!.byteOffset, back[f]!.byteLength).equals(
          Buffer.from(mb[f]!.buffer, mb[f]!.byteOffset, mb[f]!.byteLength),
        ),
      ).toBe(true);
    expect(back.meta.image_hashes).toEqual(hashes);
    expect(back.meta.image_processor).toEqual(mb.meta.image_processor);
  });

  it("keep the engine's response tokens and logprobs, and message starts, past the expanded images", async () => {
    const tok = await loadTokenizer(TOK);
    const ids = [...tok.encode('click(1)'), 151645];
    const logprobs = ids.map((_, i) => -0.125 * (i + 1));
    const rec = { ...episode()[1], response: { role: 'assistant', content: 'click(1)', token_ids: ids, logprobs } };
    const [mb] = await pack([rec], { turnIds: true });
    const trained = [...mb.loss_mask.keys()].filter((k) => mb.loss_mask[k] === 1);
    expect(trained.map((k) => mb.input_ids[mb.seq_positions[k]])).toEqual(ids);
    expect(trained.map((k) => mb.rollout_logprobs![k])).toEqual(logprobs);
    // Its one trained turn (the earlier assistant turn is context) starts at the response's header, past the images:
    // the turn start moved with the expansion.
    const first = [...mb.turn_ids!].indexOf(0);
    expect(mb.turn_ids![trained[0]]).toBe(0);
    const header = [0, 1, 2].map((d) => mb.input_ids[mb.seq_positions[first + d]]);
    expect(tok.decode(header)).toBe('<|im_start|>assistant\n');
    expect(trained[0] - first).toBe(3);
  });

  it('padded, give pad nodes position 0 in every rotary row', async () => {
    const [mb] = await pack(episode(), { budget: { maxTokens: 4096, padMultiple: 64 } });
    const N = mb.input_ids.length,
      pad = mb.meta.num_pad_tokens!;
    expect(pad).toBeGreaterThan(0);
    expect(mb.mrope_position_ids!.length).toBe(3 * N);
    for (let d = 0; d < 3; d++) expect(mb.mrope_position_ids!.subarray(d * N + N - pad, (d + 1) * N).every((x) => x === 0)).toBe(true);
    writeMicroBatch(path.join(tmp, 'padded.safetensors'), mb); // the writer's shape checks hold with padding
  });

  it('are checked by the writer: all together, shapes from the header, fills inside images and nodes', async () => {
    const [mb] = await pack(episode());
    const refused = (bad: MicroBatch, field: string) => {
      const err = (() => {
        try {
          writeMicroBatch(path.join(tmp, 'bad.safetensors'), bad);
        } catch (e) {
          return e as TreepackError;
        }
      })();
      expect(err?.code).toBe('E_ARG');
      expect(err?.where.field).toBe(field);
      expect(fs.existsSync(path.join(tmp, 'bad.safetensors'))).toBe(false);
    };
    refused({ ...mb, image_sizes: undefined }, 'image_sizes');
    refused({ ...mb, meta: { ...mb.meta, image_hashes: mb.meta.image_hashes!.slice(1) } }, 'image_sizes');
    const fills = mb.image_fills!.slice();
    fills[3] = 1000; // a count past the image's placeholders
    refused({ ...mb, image_fills: fills }, 'image_fills');
    refused({ ...mb, mrope_position_ids: mb.mrope_position_ids!.subarray(3) }, 'mrope_position_ids');
  });

  it('cut into budgeted micro-batches, each carries its own images and fills', async () => {
    const whole = (await pack(episode()))[0];
    const cut = await pack(episode(), { budget: { maxTokens: Math.ceil(whole.input_ids.length / 2) + 40 } });
    expect(cut.length).toBeGreaterThan(1);
    for (const mb of cut) {
      const imageNodes = mb.input_ids.filter((x) => x === IMAGE_PAD).length;
      const filled = mb.image_fills ? mb.image_fills.filter((_, k) => k % 4 === 3).reduce((a, b) => a + b, 0) : 0;
      expect(filled).toBe(imageNodes);
    }
  });
});

await describeBackends('packForest', (backend) => {
  it('keeps images apart and shares resent ones, as the js reference does', async () => {
    const tok = await loadTokenizer(TOK);
    const enc = new ChatEncoder(tok);
    const samples = episode()
      .flatMap((r, k) => parseRecords(r, { file: path.join(tmp, 'x.jsonl'), line: k + 1 }))
      .map((r) => enc.encode(r));
    const seqs = toSequences(samples);
    const { kernel } = await resolveKernel('packForest', backend);
    const got = kernel(seqs);
    const want = packForest(seqs);
    for (const f of ['input_ids', 'position_ids', 'parent', 'subtree_end', 'seq_positions'] as const) expect(got[f]).toEqual(want[f]);
  });
});

describe('treepack stats on an image-heavy workload', () => {
  it('counts image tokens and vision-encoder runs, unpacked and packed', { timeout: 120_000 }, () => {
    // 2 episodes × 4 calls, call k resending screenshots 0..k: 2 × (1+2+3+4) = 20 image parts, 8 distinct
    // screenshots of 56 × 84 (6 placeholders each), each under one prefix (its episode's chain).
    const file = writeImageWorkload(path.join(tmp, 'workload'), { episodes: 2, steps: 4, height: 56, width: 84 });
    const r = cli(['stats', '--tokenizer', TOK, '--json', file]);
    expect(r.code, r.stderr).toBe(0);
    const report = JSON.parse(r.stdout) as { images: Record<string, number>; micro_batches: number };
    expect(report.micro_batches).toBe(1);
    expect(report.images).toEqual({
      encoder_calls_naive: 20,
      encoder_calls_packed: 8,
      distinct_images: 8,
      naive_image_tokens: 120,
      packed_image_tokens: 48,
    });
    const text = cli(['stats', '--tokenizer', TOK, file]);
    expect(text.stdout).toContain('vision encoder runs 20 unpacked (once per image per call), 8 packed');
  });
});

describe('bad image inputs', () => {
  const one = (content: unknown[]) => [{ id: 'bad/0', messages: [{ role: 'user', content }], response: 'ok' }];
  const expectRefused = async (lines: unknown[], field: RegExp, message: RegExp) => {
    const out = path.join(tmp, 'never-written');
    const err = await pack(lines).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(TreepackError);
    expect((err as TreepackError).message).toMatch(message);
    expect((err as TreepackError).message).toContain('bad/0');
    expect((err as TreepackError).message).toMatch(field);
    expect(fs.existsSync(out)).toBe(false);
  };
  it('an undecodable image', () =>
    expectRefused(
      one([imagePart(dataUrl(Buffer.from('not an image at all')))]),
      /messages\[0\]\.content\[0\]\.image_url\.url/,
      /not a PNG or JPEG/,
    ));
  it('a remote URL', () =>
    expectRefused(one([imagePart('https://example.com/a.png')]), /content\[0\]\.image_url\.url/, /never fetches over the network/));
  it('a missing file', () =>
    expectRefused(one([imagePart('nowhere.png')]), /content\[0\]\.image_url\.url/, /cannot read image file .*ENOENT/));
  it('an image the processor refuses', () =>
    expectRefused(
      one([{ type: 'text', text: 'x' }, imagePart(dataUrl(png(1, 250, 4)))]),
      /content\[1\]\.image_url/,
      /aspect ratio must be smaller than 200/,
    ));
  it('a placeholder count that does not match', () =>
    expectRefused(
      [
        {
          id: 'bad/0',
          messages: [{ role: 'user', content: [imagePart(dataUrl(A)), { type: 'text', text: 'see <|image_pad|>' }] }],
          response: 'ok',
        },
      ],
      /messages/,
      /rendered 2 image placeholder token\(s\) .* for 1 image/,
    ));
});
