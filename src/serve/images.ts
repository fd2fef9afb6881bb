/**
 * The images of recorded calls, stored once per distinct image. A call's `image_url` parts go to the engine as the
 * client sent them (data URLs); the call is recorded with each part's URL replaced by a reference to the image's
 * bytes (`treepack-image:<sha256 of the bytes>`), which are written, fsync'd, under the data directory's `images/`
 * before the call's log line is. An agent that resends every earlier screenshot so costs the log and the pool a few
 * dozen bytes per resent image, and a replayed or compacted log finds every image its calls name.
 *
 * What reads a recorded call as a record (the step packer, the episode routes) gets the data URLs back
 * (`hydrate`): the records of the service are what `treepack pack` reads, images included. On the shared pool the
 * bytes go to Redis too (`treepack:image:<sha256>`), so a trainer feed on another gateway packs them.
 */
import { createHash, randomBytes } from 'node:crypto';
import { mkdirSync } from 'node:fs';
import { open, readFile, rename, rm } from 'node:fs/promises';
import path from 'node:path';
import { TreepackError } from '../errors.js';
import { ioError, syncDirectory } from '../io/atomic.js';
import { dataUrlBytes } from '../records/images.js';
import type { Episode, RecordedCall } from './pool.js';

/** The scheme of a recorded image reference: the sha256 (hex) of the image's bytes follows. */
export const IMAGE_REF = 'treepack-image:';

type Obj = Record<string, unknown>;

/** Where images live besides the data directory (the shared pool): the bytes of an image by its sha256. */
export interface SharedImages {
  putImage(sha: string, bytes: Buffer): Promise<void>;
  getImage(sha: string): Promise<Buffer | undefined>;
}

/** A data URL of image bytes, its type told by their signature (what the packer's decoder reads: PNG or JPEG). */
export function imageDataUrl(bytes: Buffer): string {
  const mime = bytes.length >= 3 && bytes[0] === 0xff && bytes[1] === 0xd8 ? 'image/jpeg' : 'image/png';
  return `data:${mime};base64,${bytes.toString('base64')}`;
}

/** Calls `f` on every image part of `messages` (chat messages as recorded or sent). */
function eachImagePart(messages: readonly unknown[] | undefined, f: (part: Obj) => void): void {
  for (const m of messages ?? []) {
    const content = (m as Obj | null)?.content;
    if (!Array.isArray(content)) continue;
    for (const p of content) if ((p as Obj | null)?.type === 'image_url') f(p as Obj);
  }
}

/** `messages` with each image part replaced by `f(part)` (other messages and parts are the same objects). */
function mapImageParts(messages: readonly unknown[], f: (part: Obj) => Obj): unknown[] {
  return messages.map((m) => {
    const content = (m as Obj | null)?.content;
    if (!Array.isArray(content)) return m;
    const parts = content as unknown[];
    if (!parts.some((p) => (p as Obj | null)?.type === 'image_url')) return m;
    return { ...(m as Obj), content: parts.map((p) => ((p as Obj | null)?.type === 'image_url' ? f(p as Obj) : p)) };
  });
}

const urlOf = (part: Obj): unknown => (part.image_url as Obj | null | undefined)?.url;

export class ImageStore {
  readonly dir: string;
  /** images known to be durable here (and in the shared pool, when there is one) */
  private readonly stored = new Set<string>();

  constructor(
    dataDir: string,
    private readonly shared?: SharedImages,
  ) {
    this.dir = path.join(dataDir, 'images');
  }

  /**
   * The messages as the log records them: each data URL's bytes stored (once per distinct image) and the URL
   * replaced by its reference. The messages were checked (chat-check.ts): every image part is a data URL.
   */
  async record(messages: readonly unknown[]): Promise<unknown[]> {
    const refs = new Map<string, string>();
    const pending: Promise<void>[] = [];
    eachImagePart(messages, (part) => {
      const url = urlOf(part) as string;
      if (refs.has(url)) return;
      const bytes = dataUrlBytes(url)!;
      const sha = createHash('sha256').update(bytes).digest('hex');
      refs.set(url, IMAGE_REF + sha);
      pending.push(this.put(sha, bytes));
    });
    if (refs.size === 0) return messages as unknown[];
    await Promise.all(pending);
    return mapImageParts(messages, (part) => ({
      ...part,
      image_url: { ...(part.image_url as Obj), url: refs.get(urlOf(part) as string) },
    }));
  }

  /** Writes an image's bytes (to a temporary file, fsync'd, renamed, directory fsync'd) unless already stored. */
  private async put(sha: string, bytes: Buffer): Promise<void> {
    if (this.stored.has(sha)) return;
    const file = path.join(this.dir, sha);
    mkdirSync(this.dir, { recursive: true, mode: 0o700 });
    const tmp = `${file}.tmp-${randomBytes(6).toString('hex')}`;
    try {
      const fh = await open(tmp, 'wx', 0o600);
      try {
        await fh.writeFile(bytes);
        await fh.datasync();
      } finally {
        await fh.close();
      }
      await rename(tmp, file);
      syncDirectory(this.dir);
    } catch (err) {
      await rm(tmp, { force: true });
      throw ioError(err, file, 'store an image');
    }
    await this.shared?.putImage(sha, bytes);
    this.stored.add(sha);
  }

  /** An image's bytes by its sha256: the data directory's copy, else the shared pool's. */
  private async bytes(sha: string): Promise<Buffer> {
    const file = path.join(this.dir, sha);
    try {
      return await readFile(file);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw ioError(err, file);
    }
    const shared = await this.shared?.getImage(sha);
    if (shared) return shared;
    throw new TreepackError('E_INPUT', `recorded image ${sha} is missing from ${this.dir}${this.shared ? ' and the shared pool' : ''}`, {
      file,
    });
  }

  /**
   * `ep` with its calls' image references replaced by data URLs (a new episode: the pool's stays as it is). Calls
   * sharing a message object share its copy, so an episode cloned to the packing thread carries each message once.
   * An image gone from the store is an E_INPUT TreepackError (the episode cannot be trained); others are I/O errors.
   */
  async hydrate(ep: Episode): Promise<Episode> {
    const shas = new Set<string>();
    for (const call of ep.calls)
      eachImagePart(call.request.messages, (part) => {
        const url = urlOf(part);
        if (typeof url === 'string' && url.startsWith(IMAGE_REF)) shas.add(url.slice(IMAGE_REF.length));
      });
    if (shas.size === 0) return ep;
    const urls = new Map<string, string>();
    for (const sha of shas) urls.set(sha, imageDataUrl(await this.bytes(sha)));
    const copies = new Map<unknown, unknown>();
    const hydrated = (m: unknown): unknown => {
      if (!copies.has(m))
        copies.set(
          m,
          mapImageParts([m], (part) => {
            const url = urlOf(part) as string;
            if (!url.startsWith(IMAGE_REF)) return part;
            return { ...part, image_url: { ...(part.image_url as Obj), url: urls.get(url.slice(IMAGE_REF.length)) } };
          })[0],
        );
      return copies.get(m);
    };
    const calls: RecordedCall[] = ep.calls.map((c) =>
      c.request.messages ? { ...c, request: { ...c.request, messages: c.request.messages.map(hydrated) } } : c,
    );
    return { ...ep, calls };
  }
}
