// How the CUDA C ABI reports failure: the statuses of native/core/abi.h, as the CPU core does. A CUDA runtime error
// becomes TP_ERR_ALLOC (out of memory) or TP_ERR_DEVICE, and is kept per thread for tp_cuda_last_error.
#ifndef TREEPACK_CUDA_STATUS_H
#define TREEPACK_CUDA_STATUS_H

#include <cuda_runtime.h>

#include "../core/abi.h"

namespace treepack {
namespace cuda {

// Records `err` for tp_cuda_last_error, clears the runtime's own last error (or the next valid call would fail on
// it) and returns the status.
int Fail(cudaError_t err);

inline int Status(cudaError_t err) { return err == cudaSuccess ? TP_OK : Fail(err); }

}  // namespace cuda
}  // namespace treepack

#endif  // TREEPACK_CUDA_STATUS_H
