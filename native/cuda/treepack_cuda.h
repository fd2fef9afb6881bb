/*
 * treepack CUDA C ABI (libtreepack_cuda.so, and linked into treepack_cuda.node): the device layer the mask and loss
 * kernels sit on. Every function returns a status of native/core/abi.h, the same vocabulary as the CPU core, and
 * takes the arguments of its CPU twin (native/core/mask.h, loss.h) plus the stream it is enqueued on. A CUDA
 * runtime failure is TP_ERR_ALLOC (out of memory) or TP_ERR_DEVICE; tp_cuda_last_error() then gives the cudaError_t
 * and tp_cuda_error_string names it. The runtime's own last error is cleared on every failure, so a later valid
 * call is not failed by it. With static cudart nothing here needs a GPU to load: without a driver calls return
 * TP_ERR_DEVICE with last error 35 (cudaErrorInsufficientDriver), on a host with a driver but no GPU 100.
 *
 * Numerics: the loss formulas are native/core/loss_math.h's, in double, compiled with --fmad=false (no fused
 * multiply-add contractions, as on the CPU). Device exp/log are within 1 ulp (double) of the host's and the sums
 * run in another (fixed) order, so results equal the CPU core's to about 1e-12 relative before the float32
 * rounding of grad, not bit for bit; the tests hold every backend to the js reference within 1e-6.
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

/* The cudaError_t behind this thread's latest TP_ERR_DEVICE or TP_ERR_ALLOC (0 before any). */
TP_API int tp_cuda_last_error(void);

/* tp_status_string of the CPU core (the same table), from this library. */
TP_API const char* tp_cuda_status_string(int status);

/* TP_ABI, the fingerprint of the tables in abi.h this library was built with. */
TP_API const char* tp_cuda_abi(void);

/*
 * Versions (1000 * major + 10 * minor; driver 0 when there is none), the device count, and the properties of the
 * first min(count, capacity) devices. The versions are filled even when counting devices fails.
 */
TP_API int tp_cuda_device_info(int32_t* runtime_version, int32_t* driver_version, int32_t* count,
                               tp_cuda_device* devices, int32_t capacity);

/*
 * dst[i] = src[idx[i]] for i in [0, n) on device pointers, enqueued on `stream` (a cudaStream_t; NULL is the
 * default stream); an index outside [0, src_n) gives 0. This is the unmerge gather, e.g. input_ids[seq_positions].
 * Returns the launch status.
 */
TP_API int tp_cuda_gather_i32(const int32_t* src, int64_t src_n, const int32_t* idx, int64_t n, int32_t* dst,
                              void* stream);

/* The same on host arrays through the current device: copies in, gathers, copies back, synchronously. */
TP_API int tp_cuda_gather_i32_host(const int32_t* src, int64_t src_n, const int32_t* idx, int64_t n, int32_t* dst);

/*
 * Mask lowerings (native/core/mask.h gives the layouts and the arguments) on device pointers, enqueued on `stream`;
 * the whole output is written, padding included, as on the CPU. They check what they can without reading device
 * memory (TP_ERR_ARG, TP_ERR_TOO_LARGE for n > INT32_MAX); the tree's values are the caller's to check (the
 * _host forms below and src/backend/ops.ts do), and the kernels stay in bounds whatever they are.
 */
TP_API int tp_cuda_mask_dense(const int32_t* parent, const int32_t* subtree_end, int64_t n, uint8_t* out, void* stream);
TP_API int tp_cuda_mask_bits(const int32_t* parent, const int32_t* subtree_end, int64_t n, uint32_t* out, void* stream);
TP_API int tp_cuda_mask_blocks(const int32_t* subtree_end, int64_t n, int32_t block_size, int32_t* kv_num,
                               int32_t* kv_idx, int32_t* full_num, int32_t* full_idx, void* stream);

/*
 * The same on host arrays through the current device, synchronously, with the CPU core's checks (TP_ERR_TREE for a
 * tree out of range); *kernel_ms (may be NULL) gets the kernels' time alone.
 */
TP_API int tp_cuda_mask_dense_host(const int32_t* parent, const int32_t* subtree_end, int64_t n, uint8_t* out,
                                   float* kernel_ms);
TP_API int tp_cuda_mask_bits_host(const int32_t* parent, const int32_t* subtree_end, int64_t n, uint32_t* out,
                                  float* kernel_ms);
TP_API int tp_cuda_mask_blocks_host(const int32_t* subtree_end, int64_t n, int32_t block_size, int32_t* kv_num,
                                    int32_t* kv_idx, int32_t* full_num, int32_t* full_idx, float* kernel_ms);

/*
 * The RL loss (tp_loss: the same arguments and statuses) on device pointers, enqueued on `stream` (NULL = default
 * stream); returns after synchronising the stream, with the metrics in host memory `out`. Offsets and positions
 * are checked on the device (and turn ids in the turn mode), every read guarded, and the check's result read with
 * the metrics: TP_ERR_OFFSETS / TP_ERR_INDEX / TP_ERR_TURNS as tp_loss gives them (out is then untouched; grad's
 * contents are unspecified). Deterministic: no float atomics, fixed reduction order (bit-identical run to run). grad
 * may be NULL. Scratch is allocated stream-ordered (cudaMallocAsync) and freed before returning.
 */
TP_API int tp_cuda_loss(const tp_loss_config* cfg, int64_t num_seqs, const int32_t* seq_offsets, int64_t num_occ,
                        const int32_t* seq_positions, const uint8_t* loss_mask, const float* advantages,
                        const float* old_logprobs, const float* ref_logprobs, const float* rollout_logprobs,
                        const float* seq_weight, const int32_t* turn_ids, int64_t num_nodes, const float* lp,
                        float* grad, tp_loss_metrics* out, void* stream);

/* The compact per-node form (tp_loss_compact: the same arguments and statuses, ref required with KL) on device
 * pointers. */
TP_API int tp_cuda_loss_compact(const tp_loss_config* cfg, int64_t num_nodes, const float* lp, const float* old,
                                const float* ref, const float* pos_weight, const float* neg_weight,
                                const float* kl_weight, const int32_t* n_train, const int32_t* n_pos,
                                const int32_t* n_neg, float* grad, tp_loss_metrics* out, void* stream);

/*
 * The same two on host arrays (copied to the current device and back), synchronously: the JS addon's path, with
 * exactly tp_loss's and tp_loss_compact's signatures. A required host array that is NULL is TP_ERR_ARG.
 */
TP_API int tp_cuda_loss_host(const tp_loss_config* cfg, int64_t num_seqs, const int32_t* seq_offsets, int64_t num_occ,
                             const int32_t* seq_positions, const uint8_t* loss_mask, const float* advantages,
                             const float* old_logprobs, const float* ref_logprobs, const float* rollout_logprobs,
                             const float* seq_weight, const int32_t* turn_ids, int64_t num_nodes, const float* lp,
                             float* grad, tp_loss_metrics* out);
TP_API int tp_cuda_loss_compact_host(const tp_loss_config* cfg, int64_t num_nodes, const float* lp, const float* old,
                                     const float* ref, const float* pos_weight, const float* neg_weight,
                                     const float* kl_weight, const int32_t* n_train, const int32_t* n_pos,
                                     const int32_t* n_neg, float* grad, tp_loss_metrics* out);

#ifdef __cplusplus
}
#endif

#endif /* TREEPACK_CUDA_H */
