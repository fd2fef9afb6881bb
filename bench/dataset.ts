/**
 * The bench's built-in dataset (also the tests' input; not part of the package): deterministic synthetic agent
 * rollouts with the shape and redundancy of real tau-bench episodes, so benches and tests exercise the same
 * readers and the same sharing patterns without shipping third-party data:
 * one long system prompt and tool list shared by every call, groups of episodes that share a task's first user
 * message and then diverge, requests that extend the previous request, and (1 in `truncateEvery` episodes)
 * context truncation, after which requests stop extending each other.
 */
import { TreepackError } from '../src/index.js';

export interface GeneratorOptions {
  groups: number;
  episodesPerGroup?: number; // default 8
  seed?: number; // default 1
  minTurns?: number; // default 10: requests per episode
  maxTurns?: number; // default 30
  truncateEvery?: number; // default 4: every 4th episode of a group truncates its context; 0 = never
  policySections?: number; // default 10 (~3.5k tokens of system prompt, which every call repeats)
}

export interface EpisodeMessage {
  role: 'system' | 'user' | 'assistant' | 'tool';
  content: string | null;
  tool_calls?: { id: string; type: 'function'; function: { name: string; arguments: string } }[];
  tool_call_id?: string;
  name?: string;
}

export interface EpisodeJson {
  source: string;
  task_id: string;
  episode_id: string;
  meta: { reward: number; trial: number; truncated_from?: number };
  requests: { agent: string; messages: EpisodeMessage[]; tools: ToolSchema[]; response: EpisodeMessage }[];
}

/** A pre-tokenized record in the reader's format (c). */
export interface TokenSampleJson {
  id: string;
  group: string;
  episode: string;
  reward: number;
  tokens: number[];
  loss_mask: number[];
  rollout_logprobs: number[];
}

export interface ToolSchema {
  type: 'function';
  function: { name: string; description: string; parameters: Record<string, unknown> };
}

/** mulberry32: tiny, fast, and good enough for text; Math.random would make benches irreproducible. */
class Rng {
  private s: number;
  constructor(seed: number) {
    this.s = seed >>> 0;
  }
  next(): number {
    let t = (this.s = (this.s + 0x6d2b79f5) >>> 0);
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  }
  int(lo: number, hi: number): number {
    return lo + Math.floor(this.next() * (hi - lo + 1));
  }
  pick<T>(a: readonly T[]): T {
    return a[Math.floor(this.next() * a.length)];
  }
  chance(p: number): boolean {
    return this.next() < p;
  }
}

/** Independent streams per (seed, group, episode), so group g is the same whatever the number of groups. */
function derive(...parts: number[]): number {
  let h = 0x9e3779b9;
  for (const p of parts) {
    h = Math.imul(h ^ (p >>> 0), 0x85ebca6b);
    h ^= h >>> 13;
    h = Math.imul(h, 0xc2b2ae35);
    h ^= h >>> 16;
  }
  return h >>> 0;
}

const WORDS = (
  'the a an of to and in for on with at by from about as into through after over between out against during ' +
  'without before under around among flight reservation passenger booking ticket seat cabin economy business ' +
  'basic baggage bag payment card certificate gift refund change cancel modify upgrade insurance membership ' +
  'gold silver regular policy agent customer user profile account date time origin destination airport city ' +
  'airline delay status available departure arrival connection layover direct return trip one way round total ' +
  'price fee amount balance credit travel record detail information request confirmation action explicit ' +
  'please could would should must may can will need want like help check find look review confirm provide ' +
  'update book transfer verify allow deny follow list explain ask offer apply charge receive keep send cover ' +
  'original new same different current previous next first last only every each all any some other more less ' +
  'early late morning evening afternoon week month today tomorrow yesterday soon already still again also ' +
  'however therefore because unless although while when where which that this these those there here then ' +
  'rule case option choice reason situation process procedure step scope limit number name email address ' +
  'family friend colleague meeting conference vacation holiday weather schedule itinerary window aisle meal ' +
  'service support human representative tool system database message answer question problem issue result ' +
  'important clear simple possible necessary eligible valid invalid correct wrong exact specific general ' +
  'quickly carefully directly politely strictly exactly usually typically generally finally actually really'
).split(' ');
const FIRST = [
  'mia',
  'noah',
  'olivia',
  'liam',
  'emma',
  'ethan',
  'ava',
  'lucas',
  'sofia',
  'yusuf',
  'chen',
  'amelia',
  'raj',
  'isabella',
  'omar',
];
const LAST = ['li', 'brown', 'garcia', 'kim', 'nguyen', 'patel', 'rossi', 'silva', 'muller', 'ahmed', 'wang', 'taylor', 'lopez', 'sato'];
const IATA = ['SFO', 'JFK', 'LAX', 'ORD', 'DFW', 'DEN', 'SEA', 'MIA', 'BOS', 'ATL', 'PHX', 'IAH', 'EWR', 'MSP', 'DTW', 'LGA'];
const CHARS = 'ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789';
const ALNUM = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789';

function code(rng: Rng, n: number, alphabet = CHARS): string {
  let s = '';
  for (let i = 0; i < n; i++) s += alphabet[Math.floor(rng.next() * alphabet.length)];
  return s;
}

function sentence(rng: Rng, min: number, max: number): string {
  const n = rng.int(min, max);
  const w: string[] = [];
  for (let i = 0; i < n; i++) w.push(rng.pick(WORDS));
  const s = w.join(' ');
  return s[0].toUpperCase() + s.slice(1) + (rng.chance(0.15) ? '?' : '.');
}

function paragraph(rng: Rng, sentences: number): string {
  const out: string[] = [];
  for (let i = 0; i < sentences; i++) out.push(sentence(rng, 6, 22));
  return out.join(' ');
}

function date(rng: Rng): string {
  return `2024-05-${String(rng.int(1, 30)).padStart(2, '0')}`;
}

interface ToolSpec {
  name: string;
  params: [string, string][]; // name, kind
}

const TOOL_SPECS: ToolSpec[] = [
  { name: 'get_user_details', params: [['user_id', 'user']] },
  { name: 'get_reservation_details', params: [['reservation_id', 'reservation']] },
  {
    name: 'search_direct_flight',
    params: [
      ['origin', 'iata'],
      ['destination', 'iata'],
      ['date', 'date'],
    ],
  },
  {
    name: 'search_onestop_flight',
    params: [
      ['origin', 'iata'],
      ['destination', 'iata'],
      ['date', 'date'],
    ],
  },
  { name: 'list_all_airports', params: [] },
  {
    name: 'book_reservation',
    params: [
      ['user_id', 'user'],
      ['origin', 'iata'],
      ['destination', 'iata'],
      ['flight_type', 'text'],
      ['cabin', 'cabin'],
      ['total_baggages', 'int'],
      ['insurance', 'yesno'],
    ],
  },
  { name: 'cancel_reservation', params: [['reservation_id', 'reservation']] },
  {
    name: 'update_reservation_baggages',
    params: [
      ['reservation_id', 'reservation'],
      ['total_baggages', 'int'],
      ['nonfree_baggages', 'int'],
      ['payment_id', 'payment'],
    ],
  },
  {
    name: 'update_reservation_flights',
    params: [
      ['reservation_id', 'reservation'],
      ['cabin', 'cabin'],
      ['payment_id', 'payment'],
    ],
  },
  {
    name: 'send_certificate',
    params: [
      ['user_id', 'user'],
      ['amount', 'int'],
    ],
  },
  { name: 'calculate', params: [['expression', 'expr']] },
  { name: 'think', params: [['thought', 'text']] },
  { name: 'transfer_to_human_agents', params: [['summary', 'text']] },
];

function toolSchemas(rng: Rng): ToolSchema[] {
  return TOOL_SPECS.map((t) => {
    const properties: Record<string, unknown> = {};
    for (const [p, kind] of t.params) properties[p] = { type: kind === 'int' ? 'integer' : 'string', description: sentence(rng, 8, 24) };
    return {
      type: 'function',
      function: {
        name: t.name,
        description: paragraph(rng, 2),
        parameters: { type: 'object', properties, required: t.params.map(([p]) => p) },
      },
    };
  });
}

function systemPrompt(rng: Rng, count: number): string {
  const sections: string[] = ['# Airline Agent Policy', `The current time is 2024-05-15 15:00:00 EST.`];
  for (let s = 0; s < count; s++) {
    sections.push(`## ${sentence(rng, 2, 4).slice(0, -1)}`);
    for (let b = 0, n = rng.int(3, 6); b < n; b++) sections.push(`- ${paragraph(rng, rng.int(1, 3))}`);
  }
  return sections.join('\n\n');
}

interface Task {
  user: string;
  reservations: string[];
  payment: string;
  firstMessage: string;
}

function makeTask(rng: Rng): Task {
  const user = `${rng.pick(FIRST)}_${rng.pick(LAST)}_${rng.int(1000, 9999)}`;
  const reservations = Array.from({ length: rng.int(1, 4) }, () => code(rng, 6));
  const firstMessage =
    `Hi! ${sentence(rng, 8, 20)} My user id is ${user} and the reservation is ${reservations[0]}. ` + paragraph(rng, rng.int(1, 3));
  return { user, reservations, payment: `credit_card_${rng.int(1000000, 9999999)}`, firstMessage };
}

function argValue(rng: Rng, kind: string, task: Task): unknown {
  switch (kind) {
    case 'user':
      return task.user;
    case 'reservation':
      return rng.pick(task.reservations);
    case 'iata':
      return rng.pick(IATA);
    case 'date':
      return date(rng);
    case 'cabin':
      return rng.pick(['basic_economy', 'economy', 'business']);
    case 'int':
      return rng.int(0, 5);
    case 'yesno':
      return rng.pick(['yes', 'no']);
    case 'payment':
      return task.payment;
    case 'expr':
      return `${rng.int(10, 999)} * ${rng.int(2, 9)} - ${rng.int(1, 300)}`;
    default:
      return sentence(rng, 5, 16);
  }
}

function flight(rng: Rng): Record<string, unknown> {
  return {
    flight_number: `HAT${String(rng.int(1, 299)).padStart(3, '0')}`,
    origin: rng.pick(IATA),
    destination: rng.pick(IATA),
    date: date(rng),
    price: rng.int(50, 2000),
    status: rng.pick(['available', 'delayed', 'on time', 'landed']),
  };
}

function toolResult(rng: Rng, name: string, task: Task): string {
  if (name === 'calculate') return String(rng.int(1, 9999) / 4);
  if (name === 'think') return '';
  if (name === 'get_user_details')
    return JSON.stringify({
      name: { first_name: rng.pick(FIRST), last_name: rng.pick(LAST) },
      email: `${task.user}@example.com`,
      payment_methods: { [task.payment]: { source: 'credit_card', brand: 'visa', last_four: code(rng, 4, '0123456789') } },
      membership: rng.pick(['regular', 'silver', 'gold']),
      reservations: task.reservations,
    });
  if (name.startsWith('search')) return JSON.stringify(Array.from({ length: rng.int(0, 6) }, () => flight(rng)));
  if (rng.chance(0.1)) return `Error: ${sentence(rng, 4, 10)}`;
  return JSON.stringify({
    reservation_id: rng.pick(task.reservations),
    user_id: task.user,
    cabin: rng.pick(['basic_economy', 'economy', 'business']),
    flights: Array.from({ length: rng.int(1, 4) }, () => flight(rng)),
    passengers: Array.from({ length: rng.int(1, 3) }, () => ({
      first_name: rng.pick(FIRST),
      last_name: rng.pick(LAST),
      dob: `19${rng.int(50, 99)}-0${rng.int(1, 9)}-1${rng.int(0, 9)}`,
    })),
    note: paragraph(rng, rng.int(0, 2)),
  });
}

/** The structure both generators share: how long an episode is and where (if anywhere) it truncates. */
interface Plan {
  turns: number;
  truncateFrom: number; // first request with a truncated context; turns when never
  keep: number; // messages kept after the system prompt once truncating
  reward: number;
}

function plan(rng: Rng, episode: number, o: Required<GeneratorOptions>): Plan {
  const turns = rng.int(o.minTurns, o.maxTurns);
  const keep = rng.int(4, 8);
  const reward = rng.chance(0.5) ? 1 : 0;
  // Request k holds 1 + 2k messages after the system prompt: truncation must start where that exceeds `keep`.
  const lo = Math.max(Math.floor(turns / 3), Math.floor((keep - 1) / 2) + 1);
  const truncates = o.truncateEvery > 0 && episode % o.truncateEvery === o.truncateEvery - 1 && lo < turns;
  const truncateFrom = truncates ? rng.int(lo, Math.min(turns - 1, Math.max(lo, Math.floor((2 * turns) / 3)))) : turns;
  return { turns, truncateFrom, keep, reward };
}

function withDefaults(o: GeneratorOptions): Required<GeneratorOptions> {
  const r = { episodesPerGroup: 8, seed: 1, minTurns: 10, maxTurns: 30, truncateEvery: 4, policySections: 10, ...o };
  if (!Number.isInteger(r.policySections) || r.policySections < 1)
    throw new TreepackError('E_ARG', `policySections must be a positive integer, got ${r.policySections}`);
  if (!Number.isInteger(r.groups) || r.groups < 0)
    throw new TreepackError('E_ARG', `groups must be a non-negative integer, got ${r.groups}`);
  if (!Number.isInteger(r.minTurns) || r.minTurns < 1)
    throw new TreepackError('E_ARG', `minTurns must be a positive integer, got ${r.minTurns}`);
  if (!Number.isInteger(r.maxTurns) || r.maxTurns < r.minTurns)
    throw new TreepackError('E_ARG', `maxTurns must be an integer >= minTurns (${r.minTurns}), got ${r.maxTurns}`);
  return r;
}

/** Episodes in tau-bench's JSON shape (shared/data/README.md), one per group member, groups in order. */
export function* generateEpisodes(opts: GeneratorOptions): Generator<EpisodeJson> {
  const o = withDefaults(opts);
  const shared = new Rng(derive(o.seed, 0x5157));
  const system: EpisodeMessage = { role: 'system', content: systemPrompt(shared, o.policySections) };
  const tools = toolSchemas(shared);
  for (let g = 0; g < o.groups; g++) {
    const task = makeTask(new Rng(derive(o.seed, 1, g)));
    const taskId = `task-${g}`;
    for (let e = 0; e < o.episodesPerGroup; e++) {
      const rng = new Rng(derive(o.seed, 2, g, e));
      const p = plan(rng, e, o);
      const history: EpisodeMessage[] = [{ role: 'user', content: task.firstMessage }];
      const requests: EpisodeJson['requests'] = [];
      for (let k = 0; k < p.turns; k++) {
        const context = k >= p.truncateFrom ? history.slice(-p.keep) : history.slice();
        let response: EpisodeMessage;
        let next: EpisodeMessage;
        if (k < p.turns - 1 && rng.chance(0.55)) {
          const spec = rng.pick(TOOL_SPECS);
          const args: Record<string, unknown> = {};
          for (const [name, kind] of spec.params) args[name] = argValue(rng, kind, task);
          const id = `call_${code(rng, 24, ALNUM)}`;
          response = {
            role: 'assistant',
            content: null,
            tool_calls: [{ id, type: 'function', function: { name: spec.name, arguments: JSON.stringify(args) } }],
          };
          next = { role: 'tool', content: toolResult(rng, spec.name, task), tool_call_id: id, name: spec.name };
        } else {
          response = { role: 'assistant', content: paragraph(rng, rng.int(1, 4)) };
          next = { role: 'user', content: paragraph(rng, rng.int(1, 3)) };
        }
        requests.push({ agent: 'airline_agent', messages: [system, ...context], tools, response });
        history.push(response, next);
      }
      const meta: EpisodeJson['meta'] = { reward: p.reward, trial: e };
      if (p.truncateFrom < p.turns) meta.truncated_from = p.truncateFrom;
      yield { source: 'treepack/generator', task_id: taskId, episode_id: `${taskId}-ep${e}`, meta, requests };
    }
  }
}

export function* generateJsonlLines(opts: GeneratorOptions): Generator<string> {
  for (const ep of generateEpisodes(opts)) yield JSON.stringify(ep);
}

export function generateJsonl(opts: GeneratorOptions): string {
  let s = '';
  for (const line of generateJsonlLines(opts)) s += line + '\n';
  return s;
}

// Token-level stand-ins for ChatML framing, all below Qwen3's 151643 regular ids so samples pass a vocabSize check.
const TURN_START = 27;
const TURN_END = 29;
const NEWLINE = 198;
const ROLE = { system: 8948, user: 872, assistant: 77091 } as const;

/** Skewed toward small ids like real BPE frequency ranks. */
function tokenRun(rng: Rng, n: number): number[] {
  const out = new Array<number>(n);
  for (let i = 0; i < n; i++) out[i] = Math.min(151642, Math.floor(151643 * rng.next() ** 4));
  return out;
}

function turn(role: keyof typeof ROLE, body: number[]): number[] {
  return [TURN_START, ROLE[role], NEWLINE, ...body, TURN_END, NEWLINE];
}

/**
 * Pre-tokenized samples with the same plan as generateEpisodes (one per request; request k+1 extends request k
 * until truncation; a group shares the system prompt and first user turn), built directly as token ids so benches
 * and tests need no tokenizer. The loss mask covers the response body and its end-of-turn token, like ChatEncoder.
 */
export function* generateTokenSamples(opts: GeneratorOptions): Generator<TokenSampleJson> {
  const o = withDefaults(opts);
  const system = turn('system', tokenRun(new Rng(derive(o.seed, 0x5157)), 3000));
  for (let g = 0; g < o.groups; g++) {
    const first = turn('user', tokenRun(new Rng(derive(o.seed, 1, g)), 60));
    for (let e = 0; e < o.episodesPerGroup; e++) {
      const rng = new Rng(derive(o.seed, 2, g, e));
      const p = plan(rng, e, o);
      const history: number[][] = [first];
      const episode = `task-${g}-ep${e}`;
      for (let k = 0; k < p.turns; k++) {
        const context = k >= p.truncateFrom ? history.slice(-p.keep) : history;
        const prompt = system.concat(...context);
        const response = turn('assistant', tokenRun(rng, rng.int(15, 150)));
        const tokens = prompt.concat(response);
        const loss_mask = new Array<number>(tokens.length).fill(0);
        const rollout_logprobs = new Array<number>(tokens.length).fill(0);
        // Trainable: body and TURN_END; not the 3-token header nor the final newline.
        for (let t = prompt.length + 3; t < tokens.length - 1; t++) {
          loss_mask[t] = 1;
          rollout_logprobs[t] = -Math.round(rng.next() ** 3 * 8000) / 1000;
        }
        yield { id: `${episode}/${k}`, group: `task-${g}`, episode, reward: p.reward, tokens, loss_mask, rollout_logprobs };
        // Tool results are user turns in ChatML and run longer than user replies.
        history.push(response, turn('user', tokenRun(rng, rng.chance(0.55) ? rng.int(50, 400) : rng.int(10, 60))));
      }
    }
  }
}
