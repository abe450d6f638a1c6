// The linear layer's families (one translation unit each) and what they share: register-block sizes,
// prefetching, row blocking, the int8 activation rows, and the one bias-and-store epilogue.
//   linear.cpp        linear_fmt: the dispatch over (activation dtype, weight format), row_bytes
//   linear_float.cpp  fp32 / bf16 / fp16 / GGUF blocks against fp32 activations (the 16-lane contract)
//   linear_q8.cpp     GGUF blocks against int8 activations (contract q8)
//   linear_x16.cpp    16 rows interleaved against int8 / 16-bit activations (contracts q8x16, q16)
//   linear_bf16.cpp   bf16 with 16 rows interleaved (contract chain), and AVX512-BF16 pair products
// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]). x (M, K) rows `x_stride` apart; w: N rows of `rb`
// bytes; out (M, N) rows `out_stride` apart.
#pragma once

#include "formats.h"

namespace dart {

constexpr int64_t NB = 4;  // result stride of a register block (and the bf16-pair kernel's weight rows)
// The weights stream from memory once per forward, and a verify needs as much compute per weight
// byte as there is memory time per byte: both overlap only if the loads of block b + PREFETCH_BLOCKS
// are in flight while block b computes. The register blocks prefetch one line of each row at a time,
// interleaved with their arithmetic; a burst of a whole block's prefetches at its start stalled the
// arithmetic instead (9-row bf16 forward 20.8 -> 17.2 ms on a 2-core AMD EPYC; distance 4 to 12
// blocks within noise, into L1 much slower).
constexpr int64_t PREFETCH_BLOCKS = 8;  // weight blocks ahead, into L2

inline void prefetch_l2(const void* p) {
#ifdef DART_X86
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
#else
    __builtin_prefetch(p, 0, 2);
#endif
}

// Typed helpers of the bf16-pair kernel: the block PREFETCH_BLOCKS ahead of block b (nbw rows of K)
// if it is a whole one, and the lines of its rows that cover [k, k + 64 bytes).
template <class T> inline const T* weight_prefetch(const T* w, int64_t b, int64_t N, int64_t K, int64_t nbw = NB) {
    return (b + PREFETCH_BLOCKS + 1) * nbw <= N ? w + (b + PREFETCH_BLOCKS) * nbw * K : nullptr;
}
template <class T> inline void prefetch_chunk(const T* pf, int64_t K, int64_t k, int64_t rows = NB) {
    for (int64_t j = 0; j < rows; ++j) prefetch_l2(pf + j * K + k);
}

// Size of the r-th of the ceil(M / mb) row blocks, as even as possible (6 rows in blocks of 4: 3 + 3).
inline int64_t row_block(int64_t M, int64_t r, int64_t mb) {
    const int64_t n = (M + mb - 1) / mb, base = M / n;
    return base + (r < M % n ? 1 : 0);
}

// Elements per prefetched line of a format, a multiple of the loop's step (16 elements, or a 32-element
// block): one prefetch per row every so many.
template <class F> constexpr int64_t prefetch_every() {
    constexpr int64_t step = F::QUANT ? 32 : LANES;
    return std::max<int64_t>(step, (64 * F::BLOCK / F::BYTES) / step * step);
}

// The epilogue of every linear, written once: an output element's fp32 sum, plus the bias in fp32
// (one add), rounded once to the activations' dtype TX.
template <class TX> inline void store_output(TX* dst, float v, const TX* bias, int64_t n) {
    if (bias) v = v + to_f32(bias[n]);
    *dst = from_f32<TX>(v);
}
// store_output over a tile of results: output (i, j) for i < mb, j < nb is res[i * res_row + j * res_col],
// stored at out[i * out_stride + n0 + j] with bias[n0 + j] (out: the tile's first row).
template <class TX>
inline void store_tile(const float* res, int64_t res_row, int64_t res_col, int64_t mb, int64_t nb, const TX* bias, int64_t n0, TX* out,
                       int64_t out_stride) {
    for (int64_t i = 0; i < mb; ++i)
        for (int64_t j = 0; j < nb; ++j) store_output(out + i * out_stride + n0 + j, res[i * res_row + j * res_col], bias, n0 + j);
}

// Activation rows quantized to int8 (contract q8, linear_q8.cpp) or to 16 bits as two int8 digits
// (contract q16, linear_x16.cpp).
// Contract (q16): amax as in q8, dx = amax / Q16_MAX, Q = nearbyint(x / dx) clamped to +-Q16_MAX,
// split into digits hi = nearbyint(float(Q) / 255) and lo = Q - 255 hi, both in [-127, 127] (Q / 255
// is never within 0.002 of a tie, so the fp32 quotient rounds to the exact nearest integer). The
// integer sum of a block is 255 * sum(code * hi) + sum(code * lo) = sum(code * Q), exact in int32,
// and meets the weight scales exactly as q8's does (sx = dx * sum Q): the q8 contract on Q.
constexpr float Q16_MAX = 32512.0f;  // 255 * 127 + 127: the largest Q two digits of [-127, 127] hold
constexpr int32_t Q16_BASE = 255;

// A vector's elements left uninitialized by resize (for buffers every element of which is written
// before it is read: quantize_q8 writes each row, its padding included, in its own thread).
template <class T> struct UninitAlloc : std::allocator<T> {
    template <class U> struct rebind {
        using other = UninitAlloc<U>;
    };
    template <class U> void construct(U* p) { ::new (static_cast<void*>(p)) U; }
    template <class U, class... A> void construct(U* p, A&&... a) { ::new (static_cast<void*>(p)) U(std::forward<A>(a)...); }
};
template <class T> using RawVec = std::vector<T, UninitAlloc<T>>;

struct Q8Rows {  // M activation rows in int8 blocks; pairs of blocks padded with a zero block
    int64_t K = 0, nb = 0, npair = 0, nb16 = 0;
    int digits = 1;       // 1: int8 codes in q; 2: 16-bit codes, high digits in q, low digits in q2
    RawVec<int8_t> q;     // M x (npair * 64)
    RawVec<int8_t> q2;    // digits == 2: the low digits, laid out as q
    RawVec<float> dx16;   // M x npair x 16: the pair's scales, each repeated over its 8 lanes
    RawVec<float> sx;     // M x nb16 (zero past nb)
    RawVec<int32_t> isum;  // M x nb: each block's sum of codes (sx = dx * isum)
    RawVec<int16_t> q16;   // where asked: M x K, the codes themselves (digits 2: Q = 255 hi + lo; 1: q), per 4
                                // elements in the order (Q0, Q2, Q1, Q3) (a 32-bit word at 4j pairs the even
                                // elements of 4j..4j+3, at 4j + 2 the odd ones: x16_groups_q16)
    int64_t q16_rows = 0;     // q16 block-major over this many rows ((nb, q16_rows, 32): block b's rows together); 0: row-major
    bool codes_only = false;  // digits 2 with q16: only the codes Q (q and q2 stay empty)
    int16_t* q16_at(int64_t m, int64_t b) { return q16.data() + (q16_rows ? (b * q16_rows + m) * 32 : m * K + b * 32); }
    const int8_t* qrow(int64_t m) const { return q.data() + m * npair * 64; }
    const int8_t* qrow2(int64_t m) const { return q2.data() + m * npair * 64; }
    const float* dxrow(int64_t m) const { return dx16.data() + m * npair * 16; }
    const float* sxrow(int64_t m) const { return sx.data() + m * nb16; }
    const int32_t* isrow(int64_t m) const { return isum.data() + m * nb; }
};

// quantize_q8 (linear_q8.cpp): M rows of x as int8 blocks (digits 1) or 16-bit codes in two digits (2),
// with q16 also the codes themselves (Q8Rows::q16); codes_only (digits 2, q16): the codes alone, not
// the digits; blocks (with codes_only): q16 block-major (Q8Rows::q16_rows = M).
template <class TX>
void quantize_q8(const TX* x, int64_t x_stride, int64_t M, int64_t K, Q8Rows& r, int digits = 1, bool q16 = false, bool codes_only = false,
                 bool blocks = false);

// The families (each defined and instantiated for every activation dtype in its translation unit).
template <class TX, class F>
void linear_impl(const TX* x, int64_t x_stride, int64_t M, int64_t K, const uint8_t* w, int64_t rb, int64_t N, const TX* bias,
                 TX* out, int64_t out_stride);
template <class TX, class F>
void linear_q8_impl(const TX* x, int64_t x_stride, int64_t M, int64_t K, const uint8_t* w, int64_t rb, int64_t N, const TX* bias,
                    TX* out, int64_t out_stride);
template <class TX, class F, bool Wide>
void linear_q8x16_impl(const TX* x, int64_t x_stride, int64_t M, int64_t K, const uint8_t* w, int64_t rb, int64_t N, const TX* bias,
                       TX* out, int64_t out_stride);
template <class TX>
void linear_bf16x16_impl(const TX* x, int64_t x_stride, int64_t M, int64_t K, const uint8_t* wb, int64_t N, const TX* bias, TX* out,
                         int64_t out_stride);
#ifdef __AVX512BF16__
void linear_bf16_dp(const uint16_t* x, int64_t x_stride, int64_t M, int64_t K, const uint16_t* w, int64_t N, const uint16_t* bias,
                    uint16_t* out, int64_t out_stride);
#endif
// The parameter types of linear_impl, linear_q8_impl, linear_q8x16_impl (for their explicit instantiations).
#define DART_LINEAR_PARAMS(TX) const TX*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int64_t, const TX*, TX*, int64_t
// linear over every (activation dtype, weight format code) pair (linear.cpp).
template <class TX>
void linear_fmt(int wfmt, const TX* x, int64_t x_stride, int64_t M, int64_t K, const uint8_t* w, int64_t rb, int64_t N, const TX* bias,
                TX* out, int64_t out_stride);

// Dequantization of the interleaved formats (linear_x16.cpp, linear_bf16.cpp): rows (n,) of the weight
// (nullptr: rows 0..n-1) -> out (n, K) rows out_stride apart, exact (rounded to TO if narrower).
template <class F, class TO>
void dequantize_x16_impl(const uint8_t* w, int64_t rb, int64_t K, const int64_t* rows, int64_t n, TO* out, int64_t out_stride);
template <class TO> void dequantize_bf16x16_impl(const uint16_t* w, int64_t K, const int64_t* rows, int64_t n, TO* out, int64_t out_stride);

}  // namespace dart
