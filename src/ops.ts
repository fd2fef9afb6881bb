/**
 * `treepack/ops`: ops one at a time, for a trainer calling kernels itself or measuring them: what can run here
 * (listBackends), an op's checked kernel on a named backend or the best one (resolveKernel), the loss on a backend
 * (computeLoss, computeLossCompact), how long its kernels took on the device (timeKernels), and the one teardown
 * (disposeBackends).
 *
 * @module treepack/ops
 */
export {
  listBackends,
  resolveKernel,
  timeKernels,
  disposeBackends,
  configureBackends,
  computeLoss,
  computeLossCompact,
  BACKEND_NAMES,
  type BackendName,
  type BackendStatus,
  type BackendLimits,
  type BackendOptions,
  type KernelTiming,
  type LossOptions,
  type LossRun,
  type OpName,
  type Resolved,
} from './backend/index.js';
