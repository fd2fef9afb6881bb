/**
 * The stub engine of `npm run bench:serve` in a process of its own, as a real engine is: the load generator's
 * calls to it (direct, and through each gateway) then cross processes, not stay inside the bench's event loop.
 * Prints its base URL (…/v1) on stdout. `--tokenizer qwen3` (or a directory): answers with vLLM's token ids and
 * logprobs, prompts rendered with that tokenizer's chat template.
 */
import { loadTokenizer } from '../src/index.js';
import { startStubEngine } from '../test/helpers/stub-engine.js';

const at = process.argv.indexOf('--tokenizer');
const tokenizer = at > 0 && process.argv[at + 1] ? await loadTokenizer(process.argv[at + 1]) : undefined;
const stub = await startStubEngine('ok', { tokenizer });
console.log(stub.url);
