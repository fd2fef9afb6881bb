/**
 * The `unit` project's setup file (vitest.config.ts): the guard is on for the whole test file, its imports included,
 * and off after it, so a worker the pool reuses for another project's file starts clean.
 */
import { afterAll } from 'vitest';
import { installUnitLaneGuard, removeUnitLaneGuard } from './unit-lane.js';

installUnitLaneGuard();
afterAll(removeUnitLaneGuard);
