// CPU kernels for the target's decode and tree-verify forwards: a linear layer and tree attention
// whose result for a row never depends on which other rows run with it.
//
// Why: speculative decoding is lossless only if the logits of a node in a verified tree equal the
// logits a one-token step would compute at that position. BLAS / oneDNN pick different kernels (and
// so different summation orders) for different row counts, and SDPA over a tree mask sums a node's
// keys at other offsets than a one-token step does, so in bf16 the two disagree in the last bit and
// greedy texts part. Here every output element is computed by one fixed sequence of float operations
// that depends only on that row's inputs (and, for attention, on the node's own key sequence in its
// logical order: the committed prefix, then its ancestors by depth, then itself), so the results are
// bit-identical whatever the batch. The same kernels are also the fast path at decode sizes: the
// linear reads each weight block once for all rows, and the attention call also applies RoPE and
// writes the cache, replacing ~20 small torch ops per layer.
//
// Arithmetic contract (what "fixed" means): all accumulation in fp32; a dot product of length K runs
// in 16 lanes (lane l sums elements l, l+16, ... with fmaf, in order) and the lanes are then added in
// a fixed pairwise tree; the softmax sum runs the same way over the logical key index. Compiled with
// -ffp-contract=off so the compiler cannot fuse or reorder anything else. One exception, by choice:
// bf16 x bf16 on CPUs with AVX512-BF16 multiplies bf16 pairs in hardware (linear_bf16.cpp linear_bf16_dp).
//
// Weight formats: fp32, bf16, fp16, and the GGUF block formats Q8_0, Q4_0 and Q4_1 read as they are
// stored (no unpacked copy). A block weight is dequantized in registers to exactly the fp32 value the
// GGUF's own dequantization gives (d*q, or fma(d, q, m) for Q4_1: d*q is exact in fp32, so both round
// once), then enters the same 16-lane contract: a GGUF model's forward is bit-identical to the same
// forward over its dequantized fp32 copy.
//
// One set of sources, several builds (setup.py): the module is compiled once per instruction set
// (generic, avx2, avx512, avx512bf16) and dart_core/kernels/builds.py imports the best one the CPU
// runs. The 16 lanes are one zmm register on AVX-512 and two ymm registers (lanes 0-7, 8-15) on AVX2,
// reduced by the same pairwise tree, so the generic, AVX2 and AVX-512 builds give the same bits; only
// the bf16 pair products of the avx512bf16 build differ (for bf16 weights only).
//
// Element types of activations: fp32, bf16 (uint16 storage, round-to-nearest-even like torch) and
// fp16 (_Float16). Threads: OpenMP. The extension links libgomp.so.1, which resolves to the copy torch
// has already loaded, so these loops share torch's thread pool (two pools on two cores would oversubscribe).
//
// The files (one module per instruction-set build, every .cpp compiled into each; setup.py):
//   vec.h            instruction set, dtypes, conversions, fixed-order sums, the 16-lane V16
//   formats.h        weight formats and their exact dequantization
//   linear.h         the linear families (linear*.cpp, listed there) and their one epilogue
//   kernels.h        this overview; the norm, activation, attention and stack entry points
//   elementwise.cpp  residual add + RMSNorm, gated activation
//   attention.cpp    tree attention, rows of separate sequences
//   stack.cpp        the decoder stack and a DART head's draft forward, one call each
//   bindings.cpp     the Python module: argument checks, dtype dispatch, raw addresses
#pragma once

#include "linear.h"

namespace dart {

// elementwise.cpp
template <class T> void add_rmsnorm_impl(const T* x, const T* delta, const T* w, int64_t M, int64_t H, float eps, T* x_out, T* normed);
template <class T> void silu_mul_impl(const T* gu, int64_t gu_stride, int64_t M, int64_t I, T* out);

// attention.cpp (T: the activations' dtype; C: the cache's, T or fp16 beside fp32)
template <class T, class C>
void tree_attention_impl(const T* q, int64_t q_stride, const T* k, int64_t k_stride, const T* v, int64_t v_stride, const float* cos,
                         const float* sin, const int64_t* pos, C* k_cache, C* v_cache, int64_t cap, int64_t P, int64_t T_,
                         const int64_t* parents, int64_t nh, int64_t nkv, int64_t hd, float scale, T* out, int64_t out_stride);
template <class T, class C>
void rows_attention_impl(const T* q, int64_t q_stride, const T* k, int64_t k_stride, const T* v, int64_t v_stride, const float* cos,
                         const float* sin, const int64_t* committed, C* k_cache, C* v_cache, int64_t seq_stride, int64_t cap, int64_t B,
                         int64_t nh, int64_t nkv, int64_t hd, float scale, T* out, int64_t out_stride);
// Calls X(T, C) for every (activations, cache) dtype pair the attention takes.
#define DART_FOR_EACH_CACHE_DTYPE(X) X(float, float) X(uint16_t, uint16_t) X(_Float16, _Float16) X(float, _Float16)

// stack.cpp: the plans' fields (dart_core/kernels/stack.py builds the layer plan, KernelHead the draft plan)
enum PlanField : int64_t {
    QKV_FMT, QKV_W, QKV_RB, QKV_B, O_FMT, O_W, O_RB, W13_FMT, W13_W, W13_RB, W2_FMT, W2_W, W2_RB, ATT_NORM, FFN_NORM, PLAN_FIELDS
};
enum DraftField : int64_t {
    FC_FMT, FC_W, FC_RB, DQKV_FMT, DQKV_W, DQKV_RB, DO_FMT, DO_W, DO_RB, DGU_FMT, DGU_W, DGU_RB, DDOWN_FMT, DDOWN_W, DDOWN_RB,
    LM_FMT, LM_W, LM_RB, INPUT_NORM, HIDDEN_NORM, POST_NORM, FINAL_NORM, MASK_REP, DRAFT_FIELDS
};
template <class T, class C>
void layers_forward_impl(const int64_t* plan, int64_t L, int64_t T_, int64_t H, int64_t I, int64_t nh, int64_t nkv, int64_t hd, float eps,
                         const float* cos, const float* sin, const int64_t* pos, const int64_t* parents, int64_t P, C* k_cache,
                         C* v_cache, int64_t layer_stride, int64_t seq_stride, int64_t cap, T* x, T* pending, const int64_t* capture,
                         int64_t n_capture, T* captured);
template <class T>
void draft_forward_impl(const int64_t* pl, int64_t S, int64_t D, int64_t H, int64_t I, int64_t Vd, int64_t nh, int64_t nkv, int64_t hd,
                        float eps, bool double_norm, const T* aux, const T* emb, const float* cos, const float* sin, int64_t P, T* k_cache,
                        T* v_cache, int64_t cap, T* logits);

// The clock and the arithmetic instructions' issue rates per cycle on one core (probe.cpp).
std::vector<std::pair<std::string, double>> issue_rates();

}  // namespace dart
