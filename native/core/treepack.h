/*
 * treepack C ABI: the CPU core behind the N-API addon, also loadable from Python ctypes (libtreepack_core.so).
 * No N-API or C++ types cross this boundary; every function reports failure through an int status code.
 *
 * Packing is two steps so the sort, which is what decides the packed length N, runs once:
 *
 *   tp_plan* plan; int64_t n;
 *   int rc = tp_plan_create(tokens, M, offsets, S, &plan, &n);      // sorts, gives N
 *   ... allocate four int32 arrays of N and one of M ...
 *   rc = tp_plan_layout(plan, input_ids, position_ids, parent, subtree_end, seq_positions);
 *   tp_plan_free(plan);
 *
 * The arrays are those of the packed micro-batch contract (docs/design.md §3) and equal, byte for byte, what the
 * TypeScript reference `packForest` (src/pack/forest.ts) produces. seq_offsets is the input `offsets` unchanged.
 */
#ifndef TREEPACK_H
#define TREEPACK_H

#include <stdint.h>

#include "abi.h" /* status codes, loss config and metrics: generated from src/backend/abi.ts */

#if defined(_WIN32)
#define TP_API __declspec(dllexport)
#else
#define TP_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Keep equal to package.json "version"; test/native.test.ts checks it. */
#define TP_VERSION "0.1.0"

/* Opaque: the sorted order of the sequences plus the scratch the layout needs. */
typedef struct tp_plan tp_plan;

/* "0.1.0"; static storage. */
TP_API const char* tp_version(void);

/* A static English description of a status code (an unknown code gives "unknown treepack status"). */
TP_API const char* tp_status_string(int code);

/* TP_ABI, the fingerprint of the tables in abi.h this library was built with; static storage. */
TP_API const char* tp_abi(void);

/*
 * Sorts the S sequences tokens[offsets[i] .. offsets[i+1]) and writes the packed length N (number of distinct
 * non-empty prefixes) to *num_nodes. offsets has S+1 entries. The plan borrows tokens and offsets: both must stay
 * alive and unchanged until tp_plan_free. tokens may be NULL when num_tokens is 0. On failure *plan_out is NULL.
 */
TP_API int tp_plan_create(const int32_t* tokens, int64_t num_tokens, const int32_t* offsets, int64_t num_seqs,
                          tp_plan** plan_out, int64_t* num_nodes);

/*
 * Fills the node arrays (N entries each) and seq_positions (M entries). The five arrays must not overlap each other
 * or the plan's inputs. A pointer may be NULL only when its length is 0. May be called more than once.
 */
TP_API int tp_plan_layout(tp_plan* plan, int32_t* input_ids, int32_t* position_ids, int32_t* parent,
                          int32_t* subtree_end, int32_t* seq_positions);

/* Accepts NULL. */
TP_API void tp_plan_free(tp_plan* plan);

#ifdef __cplusplus
}
#endif

#include "mask.h"
#include "loss.h"
#include "check.h"

#endif /* TREEPACK_H */
