// TP_HD marks the formulas the C++ core and the CUDA kernels share: inline on the host, __host__ __device__ inline
// under nvcc.
#ifndef TREEPACK_INLINE_H
#define TREEPACK_INLINE_H

#ifdef __CUDACC__
#define TP_HD __host__ __device__ inline
#else
#define TP_HD inline
#endif

#endif  // TREEPACK_INLINE_H
