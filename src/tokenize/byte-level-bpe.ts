/**
 * A fast encoder for byte-level BPE tokenizers split by regex (Qwen2/3, Llama 3 and the like) that gives exactly
 * the ids of @huggingface/tokenizers' `Tokenizer.encode(text, { add_special_tokens: false })`.
 *
 * The library builds a Map over 151k JSON-stringified merge pairs at load and merges strings per pre-token; here
 * merges are a hash table over token ids in typed arrays and each distinct pre-token is merged once. The steps
 * stay the library's: added tokens split first (longest match, left to right), then the normalizer, then the
 * library's own Split pre-tokenizers (same compiled regex), then the byte-to-char table of its ByteLevel
 * pre-tokenizer. `byteLevelBpe` accepts only the configurations where each step is provably the library's and
 * says why otherwise, so the caller falls back to the library (test/byte-level-bpe.test.ts compares ids on large corpora).
 */
import * as hf from '@huggingface/tokenizers';

type Json = Record<string, unknown>;

interface SplitPreTokenizer {
  pre_tokenize_text(text: string): string[];
}

// The package's index.d.ts re-exports its classes without file extensions, which NodeNext does not resolve.
const { SplitPreTokenizer, ByteLevelPreTokenizer } = hf as unknown as {
  SplitPreTokenizer: new (config: Json) => SplitPreTokenizer;
  ByteLevelPreTokenizer: new (config: Json) => { byte_encoder: Record<number, string> };
};

const MAX_CACHED_PIECE = 256; // longer pre-tokens rarely repeat
const MAX_CACHE_CHARS = 16 * 1024 * 1024;

/** Returns the encoder, or why this tokenizer.json is not one it reproduces exactly. */
export function byteLevelBpe(json: Json, config: Json): ByteLevelBpe | string {
  if (config.remove_space === true || config.do_lowercase_and_remove_accent) return 'config rewrites spaces or case';
  // What the library's constructor checks, so that building it later (for decode) cannot fail.
  for (const key of ['model', 'decoder', 'post_processor', 'pre_tokenizer', 'normalizer'])
    if (!(key in json)) return `tokenizer.json has no ${key}`;
  const decoder = json.decoder as Json | null;
  if (decoder && decoder.type !== 'ByteLevel') return `decoder ${String(decoder.type)}`;
  const normalizer = json.normalizer as Json | null | undefined;
  if (normalizer && normalizer.type !== 'NFC') return `normalizer ${String(normalizer.type)}`;
  const post = json.post_processor as Json | null | undefined;
  // The library's ByteLevel post-processor returns its input.
  if (post && post.type !== 'ByteLevel') return `post-processor ${String(post.type)}`;

  const pre = json.pre_tokenizer as Json | null | undefined;
  const steps = pre?.type === 'Sequence' && Array.isArray(pre.pretokenizers) ? (pre.pretokenizers as Json[]) : [];
  const last = steps[steps.length - 1];
  if (!last || last.type !== 'ByteLevel' || last.add_prefix_space === true || last.use_regex !== false)
    return 'pre-tokenizer is not a Sequence ending in ByteLevel without prefix space or regex';
  if (!steps.slice(0, -1).every((s) => s?.type === 'Split')) return 'pre-tokenizer has a step other than Split';

  const model = json.model as Json | undefined;
  if (!model || model.type !== 'BPE') return `model ${String(model?.type)}`;
  if (model.byte_fallback || model.end_of_word_suffix || model.continuing_subword_suffix || model.fuse_unk)
    return 'BPE with byte fallback, suffixes or fused unknowns';
  const vocab = model.vocab as Json | undefined;
  const merges = model.merges as unknown[] | undefined;
  if (!vocab || typeof vocab !== 'object' || Array.isArray(vocab) || !Array.isArray(merges)) return 'BPE without vocab or merges';

  const added = (json.added_tokens as Json[] | undefined) ?? [];
  for (const t of added) {
    if (typeof t.content !== 'string' || typeof t.id !== 'number') return 'added token without content or id';
    if (t.lstrip || t.rstrip) return `added token ${t.content} strips spaces`;
    // A normalized added token is matched again after normalization, a pass this encoder does not do.
    if (normalizer && ((t.normalized as boolean | undefined) ?? !t.special)) return `added token ${t.content} is normalized`;
  }

  // Strings are represented by their vocab id, so ids must be distinct and every string a merge uses or makes
  // must be in the vocab (the library would otherwise merge strings that have no id).
  const ids = new Map<string, number>();
  let maxVocabId = -1;
  for (const k of Object.keys(vocab)) {
    const id = vocab[k];
    if (typeof id !== 'number' || !Number.isInteger(id) || id < 0 || id >= 1 << 24) return `vocab id of ${k} is not a small integer`;
    ids.set(k, id);
    if (id > maxVocabId) maxVocabId = id;
  }
  const seen = new Uint8Array(maxVocabId + 1);
  for (const id of ids.values()) {
    if (seen[id]) return `vocab id ${id} is used twice`;
    seen[id] = 1;
  }
  const byteLevel = new ByteLevelPreTokenizer(last);
  const byteIds = new Int32Array(256);
  for (let b = 0; b < 256; b++) {
    const id = ids.get(byteLevel.byte_encoder[b]);
    if (id === undefined) return `byte ${b} has no token`;
    byteIds[b] = id;
  }
  const table = new PairTable(merges.length);
  for (let rank = 0; rank < merges.length; rank++) {
    const m = merges[rank];
    // The library's two merge formats; `split(' ', 2)` drops anything past a second space, as it does.
    const pair = typeof m === 'string' ? m.split(' ', 2) : m;
    if (!Array.isArray(pair) || pair.length !== 2 || typeof pair[0] !== 'string' || typeof pair[1] !== 'string')
      return `merge ${rank} is not a pair of strings`;
    const a = ids.get(pair[0]);
    const b = ids.get(pair[1]);
    const ab = ids.get(pair[0] + pair[1]);
    if (a === undefined || b === undefined || ab === undefined) return `merge ${rank} uses or makes a string outside the vocab`;
    table.set(a, b, rank, ab); // a repeated pair keeps its last rank, as the library's Map does
  }

  // Output ids as the library maps token strings: added tokens first, then the vocab.
  const addedIds = new Map<string, number>();
  for (const t of added) addedIds.set(t.content as string, t.id as number);
  const remap = new Map<number, number>();
  for (const [content, id] of addedIds) {
    const v = ids.get(content);
    if (v !== undefined) remap.set(v, id);
  }
  return new ByteLevelBpe({
    splits: steps.slice(0, -1).map((s) => new SplitPreTokenizer(s)),
    nfc: !!normalizer,
    byteIds,
    table,
    addedIds,
    remap,
    ignoreMerges:
      model.ignore_merges === true ? { ids, byteChars: Array.from({ length: 256 }, (_, b) => byteLevel.byte_encoder[b]) } : undefined,
    maxVocabId,
  });
}

interface Parts {
  splits: SplitPreTokenizer[];
  nfc: boolean;
  byteIds: Int32Array;
  table: PairTable;
  addedIds: Map<string, number>;
  remap: Map<number, number>;
  /** The library emits a pre-token that is itself in the vocab (added tokens included) without merging. */
  ignoreMerges: { ids: Map<string, number>; byteChars: string[] } | undefined;
  maxVocabId: number;
}

export class ByteLevelBpe {
  /** Largest id of the model's vocab (added tokens not included). */
  readonly maxVocabId: number;
  private readonly p: Parts;
  /** Added tokens by first UTF-16 unit, longest first: the library's trie takes the longest match. */
  private readonly addedByFirst = new Map<number, string[]>();
  private readonly cache = new Map<string, Int32Array>();
  private cachedChars = 0;
  private readonly encoder = new TextEncoder();
  private bytes = new Uint8Array(1024);
  private out = new Int32Array(4096);
  private outLen = 0;
  private readonly merger = new Merger();

  constructor(parts: Parts) {
    this.p = parts;
    this.maxVocabId = parts.maxVocabId;
    for (const content of parts.addedIds.keys()) {
      if (content.length === 0) continue; // never matched by the library's splitter
      const c = content.charCodeAt(0);
      const list = this.addedByFirst.get(c) ?? [];
      list.push(content);
      list.sort((x, y) => y.length - x.length);
      this.addedByFirst.set(c, list);
    }
  }

  encode(text: string): Int32Array {
    this.outLen = 0;
    let start = 0;
    for (let i = 0; i < text.length;) {
      const match = this.addedAt(text, i);
      if (match === undefined) {
        i++;
        continue;
      }
      if (i > start) this.encodeSection(text.slice(start, i));
      this.push(this.p.addedIds.get(match)!);
      i += match.length;
      start = i;
    }
    if (start < text.length) this.encodeSection(start === 0 ? text : text.slice(start));
    return this.out.slice(0, this.outLen);
  }

  private addedAt(text: string, i: number): string | undefined {
    const list = this.addedByFirst.get(text.charCodeAt(i));
    if (list) for (const s of list) if (text.startsWith(s, i)) return s;
    return undefined;
  }

  /** Text between added tokens: normalize, pre-tokenize, then BPE per pre-token. */
  private encodeSection(section: string): void {
    const text = this.p.nfc ? section.normalize('NFC') : section;
    if (text.length === 0) return;
    const whole = this.p.addedIds.get(text); // normalization can turn text into an added token's content
    if (whole !== undefined) return this.push(whole);
    let pieces = [text];
    for (const split of this.p.splits) pieces = pieces.flatMap((x) => split.pre_tokenize_text(x));
    for (const piece of pieces) {
      const hit = this.cache.get(piece);
      if (hit) {
        this.pushAll(hit);
        continue;
      }
      const ids = this.bpe(piece);
      if (piece.length < MAX_CACHED_PIECE) {
        if (this.cachedChars > MAX_CACHE_CHARS) {
          this.cache.clear();
          this.cachedChars = 0;
        }
        this.cache.set(piece, ids);
        this.cachedChars += piece.length;
      }
      this.pushAll(ids);
    }
  }

  private bpe(piece: string): Int32Array {
    if (this.bytes.length < piece.length * 3) this.bytes = new Uint8Array(piece.length * 3);
    const n = this.encoder.encodeInto(piece, this.bytes).written;
    const bytes = this.bytes;
    const im = this.p.ignoreMerges;
    if (im) {
      let s = '';
      for (let i = 0; i < n; i++) s += im.byteChars[bytes[i]];
      const added = this.p.addedIds.get(s);
      const id = added ?? im.ids.get(s);
      if (id !== undefined) return Int32Array.of(added ?? id);
    }
    const ids = this.merger.run(bytes, n, this.p.byteIds, this.p.table);
    if (this.p.remap.size) for (let i = 0; i < ids.length; i++) ids[i] = this.p.remap.get(ids[i]) ?? ids[i];
    return ids;
  }

  private push(id: number): void {
    if (this.outLen === this.out.length) this.grow(1);
    this.out[this.outLen++] = id;
  }

  private pushAll(ids: Int32Array): void {
    if (this.outLen + ids.length > this.out.length) this.grow(ids.length);
    this.out.set(ids, this.outLen);
    this.outLen += ids.length;
  }

  private grow(extra: number): void {
    const next = new Int32Array(Math.max(this.out.length * 2, this.outLen + extra));
    next.set(this.out.subarray(0, this.outLen));
    this.out = next;
  }
}

/** Open-addressing hash table (a, b) → (rank, merged id) over typed arrays. */
class PairTable {
  private readonly mask: number;
  private readonly keyA: Int32Array;
  private readonly keyB: Int32Array;
  readonly rank: Int32Array;
  readonly merged: Int32Array;

  constructor(n: number) {
    let cap = 16;
    while (cap < n * 2) cap *= 2;
    this.mask = cap - 1;
    this.keyA = new Int32Array(cap).fill(-1);
    this.keyB = new Int32Array(cap);
    this.rank = new Int32Array(cap);
    this.merged = new Int32Array(cap);
  }

  /** Slot of (a, b), or -1. */
  find(a: number, b: number): number {
    for (let h = hash(a, b) & this.mask; ; h = (h + 1) & this.mask) {
      const k = this.keyA[h];
      if (k === -1) return -1;
      if (k === a && this.keyB[h] === b) return h;
    }
  }

  set(a: number, b: number, rank: number, merged: number): void {
    let h = hash(a, b) & this.mask;
    while (this.keyA[h] !== -1 && !(this.keyA[h] === a && this.keyB[h] === b)) h = (h + 1) & this.mask;
    this.keyA[h] = a;
    this.keyB[h] = b;
    this.rank[h] = rank;
    this.merged[h] = merged;
  }
}

function hash(a: number, b: number): number {
  const h = Math.imul(a, 0x9e3779b1) ^ Math.imul(b + 0x7f4a7c15, 0x85ebca77);
  return h ^ (h >>> 15);
}

/**
 * BPE of one pre-token, as the library does it: repeatedly merge the adjacent pair of lowest rank, the leftmost
 * on ties (its queue orders by rank + position / length). Symbols sit in a linked list over their first byte's
 * position; the heap holds rank · 2³² + position and stale entries are dropped when popped.
 */
class Merger {
  private sym = new Int32Array(64);
  private next = new Int32Array(64);
  private prev = new Int32Array(64);
  private heap = new Float64Array(64);
  private size = 0;

  run(bytes: Uint8Array, n: number, byteIds: Int32Array, table: PairTable): Int32Array {
    if (this.sym.length < n) {
      const cap = Math.max(n, this.sym.length * 2);
      this.sym = new Int32Array(cap);
      this.next = new Int32Array(cap);
      this.prev = new Int32Array(cap);
      this.heap = new Float64Array(cap);
    }
    const { sym, next, prev } = this;
    for (let i = 0; i < n; i++) {
      sym[i] = byteIds[bytes[i]]!;
      next[i] = i + 1 < n ? i + 1 : -1;
      prev[i] = i - 1;
    }
    this.size = 0;
    for (let i = 0; i + 1 < n; i++) this.offer(i, table);
    let count = n;
    while (this.size > 0) {
      const top = this.pop();
      const pos = top % 4294967296;
      const r = next[pos];
      // Stale: pos was merged into its left neighbour (prev = -2), or its pair changed since it was queued.
      if (prev[pos] === -2 || r < 0) continue;
      const slot = table.find(sym[pos], sym[r]);
      if (slot < 0 || table.rank[slot] !== (top - pos) / 4294967296) continue;
      sym[pos] = table.merged[slot]!;
      next[pos] = next[r]!;
      if (next[r] >= 0) prev[next[r]] = pos;
      prev[r] = -2;
      count--;
      if (prev[pos] >= 0) this.offer(prev[pos], table);
      if (next[pos] >= 0) this.offer(pos, table);
    }
    const ids = new Int32Array(count);
    for (let i = 0, k = 0; i >= 0; i = next[i]!) ids[k++] = sym[i]!;
    return ids;
  }

  private offer(pos: number, table: PairTable): void {
    const slot = table.find(this.sym[pos], this.sym[this.next[pos]]);
    if (slot < 0) return;
    if (this.size === this.heap.length) {
      const h = new Float64Array(this.heap.length * 2);
      h.set(this.heap);
      this.heap = h;
    }
    const heap = this.heap;
    const key = table.rank[slot] * 4294967296 + pos;
    let i = this.size++;
    while (i > 0) {
      const parent = (i - 1) >> 1;
      if (heap[parent] <= key) break;
      heap[i] = heap[parent]!;
      i = parent;
    }
    heap[i] = key;
  }

  private pop(): number {
    const heap = this.heap;
    const top = heap[0];
    const last = heap[--this.size];
    let i = 0;
    for (;;) {
      let c = 2 * i + 1;
      if (c >= this.size) break;
      if (c + 1 < this.size && heap[c + 1] < heap[c]) c++;
      if (heap[c] >= last) break;
      heap[i] = heap[c]!;
      i = c;
    }
    heap[i] = last;
    return top;
  }
}
