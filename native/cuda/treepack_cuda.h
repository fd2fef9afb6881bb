/*
 * treepack CUDA C ABI (libtreepack_cuda.so, and linked into treepack_cuda.node): the device layer the mask and loss
 * kernels sit on. Every function returns a cudaError_t value (0 = cudaSuccess); tp_cuda_error_string names it.
 * With static cudart nothing here needs a GPU to load: without a driver calls return 35
 * (cudaErrorInsufficientDriver), on a host with a driver but no GPU 100 (cudaErrorNoDevice).
 */
#ifndef TREEPACK_CUDA_H
#define TREEPACK_CUDA_H

#include <stdint.h>

#include "../core/treepack.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tp_cuda_device {
  char name[256];
  int32_t major; /* compute capability */
  int32_t minor;
  int32_t multiprocessor_count;
  int64_t total_global_mem; /* bytes */
} tp_cuda_device;

/* cudaGetErrorString: "CUDA driver version is insufficient for CUDA runtime version" for 35; static storage. */
TP_API const char* tp_cuda_error_string(int code);

/*
 * Versions (1000 * major + 10 * minor; driver 0 when there is none), the device count, and the properties of the
 * first min(count, capacity) devices. The versions are filled even when counting devices fails.
 */
TP_API int tp_cuda_device_info(int32_t* runtime_version, int32_t* driver_version, int32_t* count,
                               tp_cuda_device* devices, int32_t capacity);

/*
 * dst[i] = src[idx[i]] for i in [0, n) on device pointers, enqueued on `stream` (a cudaStream_t; NULL is the
 * default stream); an index outside [0, src_n) gives 0. This is the unmerge gather, e.g. input_ids[seq_positions].
 * Returns the launch status; errors of the kernel itself surface at the next synchronisation.
 */
TP_API int tp_cuda_gather_i32(const int32_t* src, int64_t src_n, const int32_t* idx, int64_t n, int32_t* dst,
                              void* stream);

/* The same on host arrays through the current device: copies in, gathers, copies back, synchronously. */
TP_API int tp_cuda_gather_i32_host(const int32_t* src, int64_t src_n, const int32_t* idx, int64_t n, int32_t* dst);

/*
 * Mask lowerings (native/core/mask.h gives the layouts) on device pointers, enqueued on `stream`; the whole
 * output is written, padding included. subtree_end must satisfy subtree_end[k] in (k, n]; the caller validates
 * the tree (src/mask/validate.ts). The block mask needs a device workspace of 2 * nb int32.
 */
TP_API int tp_cuda_mask_dense(const int32_t* subtree_end, int64_t n, uint8_t* out, void* stream);
TP_API int tp_cuda_mask_bits(const int32_t* subtree_end, int64_t n, uint32_t* out, void* stream);
TP_API int tp_cuda_mask_blocks(const int32_t* subtree_end, int64_t n, int32_t block_size, int32_t* workspace,
                               int32_t* kv_num, int32_t* kv_idx, int32_t* full_num, int32_t* full_idx, void* stream);

/* The same on host arrays through the current device, synchronously; *kernel_ms gets the kernels' time alone. */
TP_API int tp_cuda_mask_dense_host(const int32_t* subtree_end, int64_t n, uint8_t* out, float* kernel_ms);
TP_API int tp_cuda_mask_bits_host(const int32_t* subtree_end, int64_t n, uint32_t* out, float* kernel_ms);
TP_API int tp_cuda_mask_blocks_host(const int32_t* subtree_end, int64_t n, int32_t block_size, int32_t* kv_num,
                                    int32_t* kv_idx, int32_t* full_num, int32_t* full_idx, float* kernel_ms);

/*
 * The RL loss (native/core/loss.h semantics) on device pointers, enqueued on `stream` (NULL = default stream);
 * returns after synchronising the stream, with the metrics in host memory `out`. Arrays as tp_loss plus M (the
 * number of occurrences). Deterministic: no float atomics, fixed reduction order (bit-identical run to run). grad
 * may be NULL. Scratch is allocated stream-ordered (cudaMallocAsync) and freed before returning.
 */
TP_API int tp_cuda_loss(const tp_loss_config* cfg, int64_t num_seqs, const int32_t* seq_offsets, int64_t num_occ,
                        const int32_t* seq_positions, const uint8_t* loss_mask, const float* advantages,
                        const float* old_logprobs, const float* ref_logprobs, const float* rollout_logprobs,
                        int64_t num_nodes, const float* lp, float* grad, tp_loss_metrics* out, void* stream);

/* The compact per-node form (tp_loss_compact) on device pointers. */
TP_API int tp_cuda_loss_compact(const tp_loss_config* cfg, int64_t num_nodes, const float* lp, const float* old,
                                const float* ref, const float* pos_weight, const float* neg_weight,
                                const float* kl_weight, const int32_t* n_train, const int32_t* n_pos,
                                const int32_t* n_neg, float* grad, tp_loss_metrics* out, void* stream);

/* The same two on host arrays (copied to the current device and back), synchronously: the JS addon's path. */
TP_API int tp_cuda_loss_host(const tp_loss_config* cfg, int64_t num_seqs, const int32_t* seq_offsets,
                             const int32_t* seq_positions, const uint8_t* loss_mask, const float* advantages,
                             const float* old_logprobs, const float* ref_logprobs, const float* rollout_logprobs,
                             int64_t num_nodes, const float* lp, float* grad, tp_loss_metrics* out);
TP_API int tp_cuda_loss_compact_host(const tp_loss_config* cfg, int64_t num_nodes, const float* lp, const float* old,
                                     const float* ref, const float* pos_weight, const float* neg_weight,
                                     const float* kl_weight, const int32_t* n_train, const int32_t* n_pos,
                                     const int32_t* n_neg, float* grad, tp_loss_metrics* out);

#ifdef __cplusplus
}
#endif

#endif /* TREEPACK_CUDA_H */
