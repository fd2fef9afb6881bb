/**
 * Calls with images through `treepack serve` (src/serve/images.ts): a GUI agent's calls resend every earlier
 * screenshot (generated PNGs, data URLs) to a stub engine that expands each image's placeholder as vLLM does with
 * the VL tokenizer directory's processor.
 * - The engine gets the images as sent; each distinct image is stored once under the data directory (named by the
 *   sha256 of its bytes) and the log names it instead of holding its bytes; the episode's routes give the data URLs
 *   back; the step's micro-batch carries each distinct image once, its fills exactly on the placeholder nodes, and
 *   is byte for byte what `treepack pack` makes of the exported records.
 * - Bad inputs: a remote URL, a file path, an undecodable image, a text-only served model (400 naming the field),
 *   images over --max-image-bytes (413), none forwarded or recorded; an engine expanding images with other processor
 *   settings (a placeholder count that does not match), or an image gone from the store, gets its episode
 *   quarantined, the rest of the step trains.
 * - kill -9 of `treepack serve` after calls with images were answered: the restarted service exports and packs them.
 * - On the shared pool (Redis), a step recorded by one gateway is packed, images included, by another, which has
 *   none of them in its own data directory.
 */
import { createHash } from 'node:crypto';
import { readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { parseSafetensors } from '../src/io/safetensors.js';
import { Service, type ServiceOptions } from '../src/serve/service.js';
import { loadTokenizer, type TextTokenizer } from '../src/tokenize/tokenizer.js';
import { cli } from './helpers/cli.js';
import { redisAvailable, startRedis } from './helpers/redis.js';
import { dataUrl, imagePart, png, vlTokenizerDir } from './helpers/images.js';
import { startServeProcess, tempDir, type ServeProcess } from './helpers/serve.js';
import { startStubEngine, type StubEngine } from './helpers/stub-engine.js';

type Obj = Record<string, unknown>;

const dir = tempDir('tp-serve-images-');
const TOK = vlTokenizerDir(join(dir, 'tok'));
/** A 56 × 84 screenshot: a 4 × 6 patch grid, 6 placeholder tokens under the directory's processor. */
const shot = (k: number) => png(56, 84, k);
const PER_IMAGE = 6;
const IMAGE_PAD = 151655;

const post = (url: string, body: unknown) =>
  fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
const user = (text: string, ...images: Buffer[]) => ({
  role: 'user',
  content: [...images.map((b) => imagePart(dataUrl(b))), { type: 'text', text }],
});
const errorOf = async (r: Response) => ((await r.json()) as { error: { message: string } }).error.message;

let tok: TextTokenizer;
let stub: StubEngine | undefined;
const services: Service[] = [];
let proc: ServeProcess | undefined;

afterEach(async () => {
  for (const s of services.splice(0)) await s.close();
  await proc?.kill9();
  proc = undefined;
  await stub?.close();
  stub = undefined;
});

async function start(opts: Partial<ServiceOptions> = {}): Promise<{ base: string; data: string; svc: Service }> {
  tok ??= await loadTokenizer(TOK);
  stub ??= await startStubEngine('ok', { tokenizer: tok, record: true });
  const data = tempDir('tp-serve-images-data-');
  const svc = await Service.create({ engineUrl: stub.url, dataDir: data, port: 0, ...opts, packer: { tokenizer: TOK } });
  services.push(svc);
  return { base: await svc.listen(), data, svc };
}

/**
 * An agent episode of `steps` calls: call k sends the conversation so far, which holds screenshots 0..k of `seed`
 * (`first` in place of screenshot 0 when given); returns what it sent.
 */
async function agent(base: string, group: string, episode: string, seed: number, steps: number, first?: Buffer): Promise<Obj[][]> {
  const messages: Obj[] = [{ role: 'system', content: 'You operate a phone through screenshots.' }];
  const sent: Obj[][] = [];
  for (let k = 0; k < steps; k++) {
    messages.push(user(`step ${k}: what next?`, k === 0 && first ? first : shot(seed + k)));
    const r = await post(`${base}/groups/${group}/episodes/${episode}/v1/chat/completions`, { model: 'm', messages, logprobs: true });
    expect(r.status, await r.clone().text()).toBe(200);
    sent.push(structuredClone(messages));
    messages.push((((await r.json()) as Obj).choices as { message: Obj }[])[0].message);
  }
  return sent;
}

async function pull(base: string): Promise<{ bytes: Uint8Array; id: string }> {
  const res = await fetch(`${base}/v1/batches/next?wait=30`);
  expect(res.status, await res.clone().text()).toBe(200);
  return { bytes: new Uint8Array(await res.arrayBuffer()), id: res.headers.get('x-treepack-id')! };
}

/** `treepack pack` of `jsonl` with the service's tokenizer: its one micro-batch's bytes. */
function packCli(jsonl: string, name: string): Buffer {
  const input = join(dir, `${name}.jsonl`);
  writeFileSync(input, jsonl);
  const out = join(dir, name);
  const r = cli(['pack', input, '--out', out, '--timeline-compare-level', 'token', '--tokenizer', TOK, '--quiet']);
  expect(r.stderr).toBe('');
  const manifest = JSON.parse(readFileSync(join(out, 'manifest.json'), 'utf8')) as { micro_batches: { file: string }[] };
  expect(manifest.micro_batches).toHaveLength(1);
  return readFileSync(join(out, manifest.micro_batches[0].file));
}

const sha = (b: Buffer) => createHash('sha256').update(b).digest('hex');

describe('calls with images through the service', { timeout: 120_000 }, () => {
  it('stores each distinct image once, exports data URLs, and packs each distinct image once', async () => {
    const { base, data } = await start({ groupSize: 2 });
    // Two episodes of one group: each resends its earlier screenshots; both open on the same screenshot.
    const a = await agent(base, 'task', 'ep-a', 100, 3);
    const b = await agent(base, 'task', 'ep-b', 200, 2, shot(100));
    const distinct = [100, 101, 102, 201].map(shot);

    // The engine got the data URLs as sent and expanded each image into the processor's placeholders.
    expect(stub!.requests.map((r) => r.messages)).toEqual([...a, ...b]);
    const pads = stub!.produced.map((p) => p.prompt_token_ids.filter((t) => t === IMAGE_PAD).length);
    expect(pads).toEqual([1, 2, 3, 1, 2].map((n) => n * PER_IMAGE));

    // Stored once per distinct image, named by the sha256 of its bytes; the log holds references, not bytes.
    expect(readdirSync(join(data, 'images')).sort()).toEqual(distinct.map(sha).sort());
    for (const img of distinct) expect(readFileSync(join(data, 'images', sha(img))).equals(img)).toBe(true);
    const log = readFileSync(join(data, 'events.jsonl'), 'utf8');
    expect(log).not.toContain('base64');
    expect(log.length).toBeLessThan(distinct.reduce((n, i) => n + i.length, 0));

    // The episode as recorded gives the data URLs back.
    const ep = (await (await fetch(`${base}/v1/episodes/ep-a`)).json()) as { calls: { request: { messages: Obj[] } }[] };
    expect(ep.calls.map((c) => c.request.messages)).toEqual(a);

    for (const e of ['ep-a', 'ep-b']) expect((await post(`${base}/v1/episodes/${e}/finish`, { reward: 1 })).status).toBe(200);
    const { bytes } = await pull(base);
    const mb = parseSafetensors(bytes);
    const feed = (await (await fetch(`${base}/v1/feed`)).json()) as { prompts: Obj; quarantined: number };
    expect(feed).toMatchObject({ prompts: { promptMatched: 5, promptDrifted: 0, rendered: 0, skipped: 0 }, quarantined: 0 });

    // Each distinct image once, though the calls sent 9.
    const hashes = JSON.parse(mb.metadata.image_hashes) as string[];
    expect(hashes).toHaveLength(4);
    const t = (name: string) => mb.tensors.get(name)!.data as Int32Array;
    expect(Array.from(t('image_grid_thw'))).toEqual(new Array<number[]>(4).fill([1, 4, 6]).flat());
    expect(Array.from(t('image_sizes'))).toEqual(new Array<number[]>(4).fill([56, 84]).flat());
    // The fills cover the placeholder nodes, each exactly once, and each image's placeholders 0..5 in order.
    const ids = t('input_ids');
    const fills = t('image_fills');
    const covered = new Int32Array(ids.length);
    const perImage = new Map<number, Set<number>>();
    for (let r = 0; r < fills.length; r += 4) {
      const [img, pos, j, c] = fills.subarray(r, r + 4);
      for (let q = 0; q < c; q++) {
        covered[pos + q]++;
        perImage.set(img, (perImage.get(img) ?? new Set()).add(j + q));
      }
    }
    ids.forEach((id, p) => expect(covered[p], `node ${p}`).toBe(id === IMAGE_PAD ? 1 : 0));
    expect([...perImage.keys()].sort()).toEqual([0, 1, 2, 3]);
    for (const js of perImage.values()) expect([...js].sort()).toEqual([0, 1, 2, 3, 4, 5]);
    // ep-a's and ep-b's shared first screenshot shares its nodes: one fill for it, under the shared prefix.
    expect(fills.length / 4).toBe(4);

    // The exported records are what `treepack pack` makes the same micro-batch of.
    const jsonl =
      (await (await fetch(`${base}/v1/episodes/ep-a/records`)).text()) + (await (await fetch(`${base}/v1/episodes/ep-b/records`)).text());
    expect(jsonl).toContain(dataUrl(shot(102)));
    expect(packCli(jsonl, 'round-trip').equals(Buffer.from(bytes))).toBe(true);
  });

  it('refuses remote URLs, files, undecodable images and a text model (400), too many bytes (413), naming the field', async () => {
    const { base } = await start({ maxImageBytes: 30_000 });
    const call = (episode: string, content: unknown[]) =>
      post(`${base}/groups/g/episodes/${episode}/v1/chat/completions`, { model: 'm', messages: [{ role: 'user', content }] });
    const text = { type: 'text', text: 'look' };
    const refused: [unknown[], number, RegExp][] = [
      [
        [text, imagePart('https://example.com/a.png')],
        400,
        /field "messages\[0\]\.content\[1\]\.image_url\.url": expected a base64 data URL .*never fetches/,
      ],
      [[imagePart('shot.png'), text], 400, /field "messages\[0\]\.content\[0\]\.image_url\.url": expected a base64 data URL/],
      [
        [imagePart('data:image/png;base64,iVBORw0KGgoAAAA'), text],
        400,
        /field "messages\[0\]\.content\[0\]\.image_url\.url": undecodable image/,
      ],
      [[imagePart(dataUrl(Buffer.from('GIF89a'))), text], 400, /content\[0\]\.image_url\.url": not a PNG or JPEG image/],
      [
        [imagePart(dataUrl(png(2, 900, 1))), text],
        400,
        /content\[0\]\.image_url\.url": the qwen2_5_vl image processor refuses the image: absolute aspect ratio/,
      ],
      // two screenshots of ~19 kB each: over the 30 kB the call may carry
      [
        [imagePart(dataUrl(shot(1))), imagePart(dataUrl(shot(2))), text],
        413,
        /field "messages\[0\]\.content\[1\]\.image_url\.url": .*--max-image-bytes/,
      ],
    ];
    for (const [content, status, why] of refused) {
      const r = await call('bad', content);
      expect.soft(r.status, JSON.stringify(content).slice(0, 80)).toBe(status);
      expect.soft(await errorOf(r)).toMatch(why);
    }
    expect(stub!.calls, 'nothing forwarded').toBe(0);
    expect((await fetch(`${base}/v1/episodes/bad`)).status, 'nor recorded').toBe(404);

    const textOnly = await Service.create({
      engineUrl: stub!.url,
      dataDir: tempDir('tp-serve-images-t-'),
      port: 0,
      packer: { tokenizer: 'qwen3' },
    });
    services.push(textOnly);
    const r = await post(`${await textOnly.listen()}/groups/g/episodes/e/v1/chat/completions`, {
      model: 'm',
      messages: [user('look', shot(1))],
    });
    expect(r.status).toBe(400);
    expect(await errorOf(r)).toMatch(/content\[0\]\.image_url\.url": tokenizer .* has no image processor/);
  });

  it('quarantines an episode whose placeholder count does not match, or whose image is gone; the rest of the step trains', async () => {
    const warnings: string[] = [];
    const { base, data } = await start({ groupsPerStep: 3, warn: (m) => warnings.push(m) });
    await agent(base, 'good', 'good', 300, 2);
    // An image removed from the store (a damaged data directory) before its episode is packed.
    await agent(base, 'lost', 'lost', 350, 1);
    rmSync(join(data, 'images', sha(shot(350))));
    // The engine serves a larger min_pixels than the tokenizer directory says: smart_resize scales the 56 × 84
    // screenshot up to 112 × 140 (√(12544 / 4704) ≈ 1.63, rounded up to multiples of 28), 8 × 10 patches: 20
    // placeholders, not 6.
    stub!.imageSettings = { min_pixels: 28 * 28 * 16 };
    await agent(base, 'bad', 'bad', 400, 1);
    for (const e of ['good', 'lost', 'bad']) expect((await post(`${base}/v1/episodes/${e}/finish`, { reward: 1 })).status).toBe(200);
    const mb = parseSafetensors((await pull(base)).bytes);
    const seqs = JSON.parse(mb.metadata.sequence_ids) as string[];
    expect(new Set(seqs.map((s) => s.split('/')[0]))).toEqual(new Set(['good']));
    const q = (await (await fetch(`${base}/v1/quarantine`)).json()) as { quarantined: { episode: string; reason: string }[] };
    expect(q.quarantined.map((e) => e.episode).sort()).toEqual(['bad', 'lost']);
    const reason = (e: string) => q.quarantined.find((x) => x.episode === e)!.reason;
    expect(reason('bad')).toMatch(
      /episode bad.*prompt_token_ids.*20 image placeholder tokens \(id 151655\) where the qwen2_5_vl processor .* into 6/,
    );
    expect(reason('lost')).toMatch(new RegExp(`recorded image ${sha(shot(350))} is missing`));
    for (const e of ['"bad"', '"lost"']) expect(warnings.some((w) => w.includes(e) && w.includes('quarantined'))).toBe(true);
  });

  it('keeps images answered before a kill -9: the restarted service exports and packs them', async () => {
    tok ??= await loadTokenizer(TOK);
    stub = await startStubEngine('ok', { tokenizer: tok });
    const data = tempDir('tp-serve-images-kill-');
    const args = ['--engine', stub.url, '--data', data, '--tokenizer', TOK, '--group-size', '1'];
    proc = await startServeProcess(args);
    const sent = await agent(proc.url, 'k', 'ep-k', 500, 3);
    const before = await (await fetch(`${proc.url}/v1/episodes/ep-k/records`)).text();
    await proc.kill9();
    proc = await startServeProcess(args);
    const after = await (await fetch(`${proc.url}/v1/episodes/ep-k/records`)).text();
    expect(after).toBe(before);
    expect(after).toContain(dataUrl(shot(502)));
    const ep = (await (await fetch(`${proc.url}/v1/episodes/ep-k`)).json()) as { calls: { request: { messages: Obj[] } }[] };
    expect(ep.calls.map((c) => c.request.messages)).toEqual(sent);
    expect((await post(`${proc.url}/v1/episodes/ep-k/finish`, { reward: 1 })).status).toBe(200);
    const { bytes } = await pull(proc.url);
    expect(JSON.parse(parseSafetensors(bytes).metadata.image_hashes)).toHaveLength(3);
    const finished = await (await fetch(`${proc.url}/v1/episodes/ep-k/records`)).text(); // with its reward
    expect(packCli(finished, 'after-kill').equals(Buffer.from(bytes))).toBe(true);
  });
});

const onRedis = redisAvailable('serve-images') ? describe : describe.skip;

onRedis('calls with images on the shared pool', { timeout: 120_000 }, () => {
  it('a gateway packs the images another gateway recorded', async () => {
    const redis = await startRedis();
    try {
      const { base: A, svc: svcA } = await start({ redis: redis.url });
      const { base: B, data: dataB } = await start({ redis: redis.url });
      await agent(A, 'r', 'ep-r', 600, 2);
      expect((await post(`${A}/v1/episodes/ep-r/finish`, { reward: 1 })).status).toBe(200);
      await services.splice(services.indexOf(svcA), 1)[0].close(); // B packs the step: A is gone
      const { bytes } = await pull(B);
      expect(readdirSync(dataB)).not.toContain('images');
      const mb = parseSafetensors(bytes);
      expect(JSON.parse(mb.metadata.image_hashes)).toHaveLength(2);
      expect(mb.tensors.get('image_pixels')!.data.length).toBe(2 * 56 * 84 * 3);
    } finally {
      for (const s of services.splice(0)) await s.close(); // before Redis stops under them
      await redis.stop();
    }
  });
});
