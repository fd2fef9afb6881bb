/**
 * The stub engine of `npm run bench:serve` in a process of its own, as a real engine is: the load generator's
 * calls to it (direct, and through each gateway) then cross processes, not stay inside the bench's event loop.
 * Prints its base URL (…/v1) on stdout.
 */
import { startStubEngine } from '../test/helpers/stub-engine.js';

const stub = await startStubEngine();
console.log(stub.url);
