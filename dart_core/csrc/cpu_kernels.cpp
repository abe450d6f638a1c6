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
// bf16 x bf16 on CPUs with AVX512-BF16 multiplies bf16 pairs in hardware (linear_bf16_dp below).
//
// Weight formats: fp32, bf16, fp16, and the GGUF block formats Q8_0, Q4_0 and Q4_1 read as they are
// stored (no unpacked copy). A block weight is dequantized in registers to exactly the fp32 value the
// GGUF's own dequantization gives (d*q, or fma(d, q, m) for Q4_1: d*q is exact in fp32, so both round
// once), then enters the same 16-lane contract: a GGUF model's forward is bit-identical to the same
// forward over its dequantized fp32 copy.
//
// One source, several builds (setup.py): the module is compiled once per instruction set (generic,
// avx2, avx512, avx512bf16) and dart_core/kernels.py imports the best one the CPU runs. The 16 lanes
// are one zmm register on AVX-512 and two ymm registers (lanes 0-7, 8-15) on AVX2, reduced by the same
// pairwise tree, so the generic, AVX2 and AVX-512 builds give the same bits; only the bf16 pair
// products of the avx512bf16 build differ (for bf16 weights only).
//
// Element types of activations: fp32, bf16 (uint16 storage, round-to-nearest-even like torch) and
// fp16 (_Float16). Threads: OpenMP. The extension links libgomp.so.1, which resolves to the copy torch
// has already loaded, so these loops share torch's thread pool (two pools on two cores would oversubscribe).

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DART_X86 1
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define DART_V16_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DART_V16_AVX2 1
#endif
#if defined(DART_V16_AVX512) || defined(DART_V16_AVX2)
#define DART_V16 1
#endif

#ifndef DART_KERNELS_MODULE  // set per build by setup.py
#define DART_KERNELS_MODULE _cpu_kernels_generic
#define DART_KERNELS_PATH "generic"
#endif

namespace py = pybind11;

namespace {

constexpr int LANES = 16;

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };
// Calls fn(T{}) with T the C++ type of an activation dtype code (float, bf16 bits as uint16_t,
// _Float16): every binding's one dispatch, `what` naming it in the error for an unknown code.
template <class Fn> void with_dtype(int dtype, const char* what, Fn&& fn) {
    switch (static_cast<DType>(dtype)) {
        case DType::F32: return fn(float{});
        case DType::BF16: return fn(uint16_t{});
        case DType::F16: return fn(_Float16{});
    }
    throw std::invalid_argument(std::string(what) + ": unknown dtype code " + std::to_string(dtype));
}
// Calls fn(T{}, C{}) for the activation dtype code and the KV cache's: the same dtype, or fp32
// activations over an fp16 cache (the GGUF paths with integer activations: half the bytes a step's
// attention reads).
template <class Fn> void with_cache_dtype(int dtype, int cache_dtype, const char* what, Fn&& fn) {
    if (cache_dtype == dtype) return with_dtype(dtype, what, [&](auto t) { fn(t, t); });
    if (static_cast<DType>(dtype) == DType::F32 && static_cast<DType>(cache_dtype) == DType::F16) return fn(float{}, _Float16{});
    throw std::invalid_argument(std::string(what) + ": a cache of dtype code " + std::to_string(cache_dtype) +
                                " beside activations of code " + std::to_string(dtype) + " (the same, or fp16 beside fp32)");
}
// Weight formats (dart_core/kernels.py WEIGHT_FORMATS): the three float dtypes, then GGUF blocks.
// Q4_0X16 / Q4_1X16 / Q8_0X16: the same blocks with 16 weight rows interleaved (int8 activations
// only; see below). BF16X16: bf16 with 16 rows interleaved element by element (CPUs without bf16
// arithmetic; see "bf16, rows interleaved").
enum class WFormat : int { F32 = 0, BF16 = 1, F16 = 2, Q4_0 = 3, Q4_1 = 4, Q8_0 = 5, Q4_0X16 = 6, Q4_1X16 = 7, Q8_0X16 = 8, BF16X16 = 9 };

// ------------------------------------------------------------------------------------- conversions

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {  // bf16
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
inline float to_f32(_Float16 x) { return static_cast<float>(x); }

inline float f16_at(const uint8_t* p) {  // an fp16 stored at p (GGUF block scales), exactly
    _Float16 h;
    std::memcpy(&h, p, 2);
    return static_cast<float>(h);
}

template <class T> inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline uint16_t from_f32<uint16_t>(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);                  // round to nearest even
    return static_cast<uint16_t>(bits >> 16);
}
template <> inline _Float16 from_f32<_Float16>(float x) { return static_cast<_Float16>(x); }

#if defined(DART_X86) && (defined(__AVX2__) && defined(__F16C__))
// 8 floats rounded to bf16 exactly as from_f32<uint16_t> rounds them (nearest even; NaN -> 0x7fc0):
// the bf16 bits in the low half of each 32-bit lane.
inline __m256i bf16_rne_bits8(__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}
inline void store8_bf16_rne(uint16_t* dst, __m256 v) {
    const __m256i r = bf16_rne_bits8(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
inline __m256 bf16x8(const uint16_t* p) {  // 8 bf16 widened to fp32, exactly
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// to_f32(from_f32<uint16_t>(x)) on 8 lanes
inline __m256 round_bf16_8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_rne_bits8(v), 16)); }
#endif

template <class T> inline void load_row(const T* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
}

// ------------------------------------------------------------------------------------- fixed-order sums

inline float reduce_lanes(float* acc) {  // fixed pairwise tree: 16 -> 8 -> 4 -> 2 -> 1
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) acc[l] = acc[l] + acc[l + w];
    return acc[0];
}

inline float dot(const float* a, const float* b, int64_t n) {
    float acc[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] = std::fma(a[k + l], b[k + l], acc[l]);
    for (int l = 0; k + l < n; ++l) acc[l] = std::fma(a[k + l], b[k + l], acc[l]);
    return reduce_lanes(acc);
}

inline float sum(const float* a, int64_t n) {
    float acc[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] = acc[l] + a[k + l];
    for (int l = 0; k + l < n; ++l) acc[l] = acc[l] + a[k + l];
    return reduce_lanes(acc);
}

// exp(x) for x <= 0 (softmax after subtracting the max): Cody-Waite reduction and a degree-6
// polynomial, ~1 ulp, branch-free so loops over it vectorise; one fixed formula for every element.
inline float exp_nonpositive(float x) {
    x = std::max(x, -87.0f);
    const float n = std::nearbyint(x * 1.44269504088896341f);
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t e = static_cast<int32_t>(n) + 127;
    uint32_t bits = static_cast<uint32_t>(e) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

int n_threads() {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

// ------------------------------------------------------------------------------------- 16-lane vectors
// V16 holds the 16 lanes of the contract: one zmm on AVX-512, two ymm (lanes 0-7 | 8-15) on AVX2.
// v_reduce is reduce_lanes' tree (l + l+8, then + l+4, + l+2, + l+1); v_reduce4 reduces four vectors
// with the same additions on the same operands, so lane u equals v_reduce of the u-th vector.

#if defined(DART_V16_AVX512)
struct V16 {
    __m512 v;
};
inline V16 v_zero() { return {_mm512_setzero_ps()}; }
inline V16 v_set1(float a) { return {_mm512_set1_ps(a)}; }
inline V16 v_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 v_load(const uint16_t* p) {  // bf16
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline V16 v_load(const _Float16* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline V16 v_fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 v_mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline void v_store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline __m256 v_fold(V16 a) { return _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1)); }
// 16 signed bytes as 16 fp32 lanes
inline V16 v_i8(const uint8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))}; }
inline V16 v_sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
// The 32 4-bit values of 16 bytes (low nibbles: elements 0-15, high: 16-31) as fp32 lanes: the bytes
// are read once and split on 16 bytes, then widened (one 16-lane widening per nibble half).
inline void v_nibbles(const uint8_t* p, V16& lo, V16& hi) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), m4 = _mm_set1_epi8(0x0F);
    lo = {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, m4)))};
    hi = {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m4)))};
}
#elif defined(DART_V16_AVX2)
struct V16 {
    __m256 lo, hi;
};
inline V16 v_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v_set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V16 v_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 v_load(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline V16 v_load(const _Float16* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline V16 v_fma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 v_mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline void v_store(float* p, V16 a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
}
inline __m256 v_fold(V16 a) { return _mm256_add_ps(a.lo, a.hi); }
inline V16 v_i8(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
inline V16 v_sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
// As the AVX-512 v_nibbles: 14 instructions for the block's 32 values where widening each half from
// the bytes and shifting in 32-bit lanes took 20 (the dequantization is most of an AVX2 Q4_1 step,
// and a fixed cost of every verify).
inline void v_nibbles(const uint8_t* p, V16& lo, V16& hi) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), m4 = _mm_set1_epi8(0x0F);
    const __m128i l = _mm_and_si128(b, m4), h = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
    lo = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(l)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(l, l)))};
    hi = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(h, h)))};
}
#endif

#ifdef DART_V16
inline float v_reduce(V16 a) {
    const __m256 s8 = v_fold(a);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#if defined(DART_V16_AVX512)
inline __m128 v_reduce4(V16 v0, V16 v1, V16 v2, V16 v3) {  // the same tree, four vectors in one pass of shuffles
    const __m512 a0 = v0.v, a1 = v1.v, a2 = v2.v, a3 = v3.v;
    const __m256 t[4] = {
        _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1)),
        _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1)),
        _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1)),
        _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1)),
    };
    const __m512 u01 = _mm512_insertf32x8(_mm512_castps256_ps512(t[0]), t[1], 1);  // [t0.lo t0.hi t1.lo t1.hi]
    const __m512 u23 = _mm512_insertf32x8(_mm512_castps256_ps512(t[2]), t[3], 1);
    const __m512 lo = _mm512_shuffle_f32x4(u01, u23, _MM_SHUFFLE(2, 0, 2, 0));  // [t0.lo t1.lo t2.lo t3.lo]
    const __m512 hi = _mm512_shuffle_f32x4(u01, u23, _MM_SHUFFLE(3, 1, 3, 1));  // [t0.hi t1.hi t2.hi t3.hi]
    const __m512 s4 = _mm512_add_ps(lo, hi);
    const __m512 s2 = _mm512_add_ps(s4, _mm512_permute_ps(s4, _MM_SHUFFLE(1, 0, 3, 2)));  // x0+x2, x1+x3
    const __m512 s1 = _mm512_add_ps(s2, _mm512_permute_ps(s2, _MM_SHUFFLE(2, 3, 0, 1)));  // (x0+x2)+(x1+x3)
    return _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, s1));
}
inline __m128 reduce4_zmm(__m512 a0, __m512 a1, __m512 a2, __m512 a3) { return v_reduce4({a0}, {a1}, {a2}, {a3}); }
#else
inline __m128 v_reduce4(V16 a0, V16 a1, V16 a2, V16 a3) {
    __m128 r[4];
    const V16* a[4] = {&a0, &a1, &a2, &a3};
    for (int u = 0; u < 4; ++u) {
        const __m256 s8 = v_fold(*a[u]);
        r[u] = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));  // x0..x3 of vector u
    }
    _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]);  // r[i] lane u = x_i of vector u
    return _mm_add_ps(_mm_add_ps(r[0], r[2]), _mm_add_ps(r[1], r[3]));  // (x0 + x2) + (x1 + x3)
}
#endif
template <class T> inline V16 v_load_tail(const T* p, int64_t rem) {  // lanes >= rem are zero
    T buf[LANES] = {};
    std::memcpy(buf, p, rem * sizeof(T));
    return v_load(buf);
}
#endif

// ------------------------------------------------------------------------------------- weight formats
// How one weight row of K elements is stored: BLOCK elements in BYTES bytes. The GGUF blocks hold 32
// elements: Q8_0 {fp16 d; int8 q[32]}, w = d*q; Q4_0 {fp16 d; uint8 qs[16]}, w = d*(q-8); Q4_1
// {fp16 d, m; uint8 qs[16]}, w = fma(d, q, m); in Q4_x element i is the low nibble of qs[i] and element
// i+16 the high one. Each value is the one the GGUF's own dequantization gives in fp32 (gguf-py,
// ggml): d*q and d*(q-8) are exact, and d*q + m rounds once, as fma does.

template <class T_, int64_t BLOCK_, int64_t BYTES_, bool QUANT_>
struct Fmt {
    using T = T_;
    static constexpr int64_t BLOCK = BLOCK_, BYTES = BYTES_;
    static constexpr bool QUANT = QUANT_;
};
using FmtF32 = Fmt<float, 1, 4, false>;
using FmtBF16 = Fmt<uint16_t, 1, 2, false>;
using FmtF16 = Fmt<_Float16, 1, 2, false>;
using FmtQ8_0 = Fmt<uint8_t, 32, 34, true>;
using FmtQ4_0 = Fmt<uint8_t, 32, 18, true>;
using FmtQ4_1 = Fmt<uint8_t, 32, 20, true>;

// Elements [0, K) of one row as fp32 (the generic build, and `dequantize`).
template <class F> void dequant_row(const uint8_t* row, int64_t K, float* out) {
    if constexpr (!F::QUANT) {
        load_row(reinterpret_cast<const typename F::T*>(row), out, K);
    } else {
        for (int64_t b = 0; b < K / 32; ++b) {
            const uint8_t* blk = row + b * F::BYTES;
            float* o = out + b * 32;
            const float d = f16_at(blk);
            if constexpr (std::is_same_v<F, FmtQ8_0>) {
                for (int i = 0; i < 32; ++i) o[i] = d * static_cast<float>(static_cast<int8_t>(blk[2 + i]));
            } else if constexpr (std::is_same_v<F, FmtQ4_0>) {
                for (int i = 0; i < 16; ++i) {
                    o[i] = d * static_cast<float>((blk[2 + i] & 15) - 8);
                    o[i + 16] = d * static_cast<float>((blk[2 + i] >> 4) - 8);
                }
            } else {
                const float m = f16_at(blk + 2);
                for (int i = 0; i < 16; ++i) {
                    o[i] = std::fma(d, static_cast<float>(blk[4 + i] & 15), m);
                    o[i + 16] = std::fma(d, static_cast<float>(blk[4 + i] >> 4), m);
                }
            }
        }
    }
}

#ifdef DART_V16
// Elements [k, k+16) of one row of a float format (k a multiple of 16) as fp32 lanes.
template <class F> inline V16 w_load16(const uint8_t* row, int64_t k) {
    static_assert(!F::QUANT, "block formats read whole blocks: w_load32");
    return v_load(reinterpret_cast<const typename F::T*>(row) + k);
}

// The 32 elements of block k/32 of one row of a block format as fp32 lanes (lo: elements 0-15, hi:
// 16-31): the same values as dequant_row. The block's bytes and scales are read once for both halves.
template <class F> inline void w_load32(const uint8_t* row, int64_t k, V16& lo, V16& hi) {
    const uint8_t* blk = row + (k / 32) * F::BYTES;
    const V16 d = v_set1(f16_at(blk));
    if constexpr (std::is_same_v<F, FmtQ8_0>) {
        lo = v_mul(v_i8(blk + 2), d);
        hi = v_mul(v_i8(blk + 18), d);
    } else {
#if defined(DART_V16_AVX512)
        // A 4-bit block has 16 possible values: the table of them (one zmm: value q in lane q, each
        // computed as below) is looked up by each code with one permute, in place of converting and
        // scaling every element (2 permutes a block instead of 2 conversions and 2 fmas; the values
        // are the same, exactly). The embedded model's Q4_1 forward after 200 tokens on the Xeon,
        // medians of 3 interleaved processes: 1 row 7.99 -> 7.67 ms, 3 rows 10.70 -> 10.38.
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        V16 table;
        if constexpr (std::is_same_v<F, FmtQ4_0>) table = v_mul(v_sub({iota}, v_set1(8.0f)), d);
        else table = v_fma({iota}, d, v_set1(f16_at(blk + 2)));
        const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (std::is_same_v<F, FmtQ4_1> ? 4 : 2))));
        lo = {_mm512_permutexvar_ps(c, table.v)};  // the index is each lane's low 4 bits: the low nibble
        hi = {_mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), table.v)};
#else
        V16 ql, qh;
        if constexpr (std::is_same_v<F, FmtQ4_0>) {
            const V16 eight = v_set1(8.0f);
            v_nibbles(blk + 2, ql, qh);
            lo = v_mul(v_sub(ql, eight), d);
            hi = v_mul(v_sub(qh, eight), d);
        } else {
            const V16 m = v_set1(f16_at(blk + 2));
            v_nibbles(blk + 4, ql, qh);
            lo = v_fma(ql, d, m);
            hi = v_fma(qh, d, m);
        }
#endif
    }
}
#endif

// ------------------------------------------------------------------------------------- linear
// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]). x (M, K) rows `x_stride` apart; w: N rows of `rb`
// bytes in format F; out (M, N) rows `out_stride` apart. Every (m, n) is `dot(x[m], w[n])` of the
// contract, w[n] read exactly; blocks of NBV weight rows x MBV input rows only decide which dots run
// together, so a row's outputs never depend on M.

constexpr int64_t NB = 4;  // result stride of a register block (and the bf16-pair kernel's weight rows)
#if defined(DART_V16_AVX512)
constexpr int64_t NBV = 4, MBV = 4;  // 16 accumulators + 4 weights + 1 input of 32 zmm registers
// Block formats, 5-8 rows (a verify of 4-7 drafted nodes): ONE row block against 2 weight rows (16
// accumulators + 2 x 2 block halves + 2 inputs), so each block is dequantized once for all rows.
constexpr int64_t WIDE_NB = 2, WIDE_MB = 8;
#elif defined(DART_V16_AVX2)
constexpr int64_t NBV = 2, MBV = 2;  // 8 + 4 + 2 of 16 ymm registers (a V16 is two)
// 3-6 rows (a verify of 2-5 drafted nodes), and more in row blocks of up to 6: ONE weight row against
// up to 6 input rows (12 accumulators + 2 weights of 16 ymm registers; the inputs are memory operands
// of the fmas), so a weight row passes through the core once per 6 rows instead of once per 2 rows.
// As 2 x 2 blocks a 6-row verify was three passes. Up to 6 rows (block formats: 1-6) run in
// linear_rows_chunked_avx2, a half block dequantized in registers at a time; past 6 rows block
// formats are dequantized into L1 first (a panel of one weight row) for all row blocks.
constexpr int64_t WIDE_NB = 1, WIDE_MB = 6;
#else
constexpr int64_t NBV = 4, MBV = 4;
constexpr int64_t WIDE_NB = NBV, WIDE_MB = MBV;
#endif

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

#ifdef DART_V16
// MBc input rows x NBc weight rows in registers; res [MBc][NB].
template <class F, int MBc, int NBc>
void linear_block(const float* xf, int64_t K, const uint8_t* w, int64_t rb, float* res, const uint8_t* pf) {
    constexpr int64_t PF = prefetch_every<F>();
    V16 acc[MBc][NBc];
    for (int i = 0; i < MBc; ++i)
        for (int j = 0; j < NBc; ++j) acc[i][j] = v_zero();
    const int64_t full = K / LANES * LANES;
    if constexpr (F::QUANT) {  // a block at a time: elements k..k+15 then k+16..k+31, the contract's order
        for (int64_t k = 0; k < K; k += 32) {
            V16 lo[NBc], hi[NBc];
#pragma GCC unroll 4
            for (int j = 0; j < NBc; ++j) w_load32<F>(w + j * rb, k, lo[j], hi[j]);
            if (pf && k % PF == 0)
                for (int j = 0; j < NBc; ++j) prefetch_l2(pf + j * rb + k * F::BYTES / F::BLOCK);
#pragma GCC unroll 8
            for (int i = 0; i < MBc; ++i) {
                const V16 x0 = v_load(xf + i * K + k), x1 = v_load(xf + i * K + k + 16);
#pragma GCC unroll 4
                for (int j = 0; j < NBc; ++j) acc[i][j] = v_fma(x1, hi[j], v_fma(x0, lo[j], acc[i][j]));
            }
        }
    } else {
        for (int64_t k = 0; k < full; k += LANES) {
            V16 wv[NBc];
#pragma GCC unroll 4
            for (int j = 0; j < NBc; ++j) wv[j] = w_load16<F>(w + j * rb, k);
            if (pf && k % PF == 0)
                for (int j = 0; j < NBc; ++j) prefetch_l2(pf + j * rb + k * F::BYTES / F::BLOCK);
#pragma GCC unroll 8
            for (int i = 0; i < MBc; ++i) {
                const V16 xv = v_load(xf + i * K + k);
#pragma GCC unroll 4
                for (int j = 0; j < NBc; ++j) acc[i][j] = v_fma(xv, wv[j], acc[i][j]);
            }
        }
    }
    if constexpr (!F::QUANT) {
        // K % 16 != 0: zero-filled tail lanes add +0 products, and an accumulator that starts at +0
        // never becomes -0, so the dead lanes keep their bits (the generic loop leaves them untouched)
        if (full < K) {
            const int64_t rem = K - full;
            V16 wv[NBc];
            for (int j = 0; j < NBc; ++j) wv[j] = v_load_tail(reinterpret_cast<const typename F::T*>(w + j * rb) + full, rem);
            for (int i = 0; i < MBc; ++i) {
                const V16 xv = v_load_tail(xf + i * K + full, rem);
                for (int j = 0; j < NBc; ++j) acc[i][j] = v_fma(xv, wv[j], acc[i][j]);
            }
        }
    }
    for (int i = 0; i < MBc; ++i) {
        if constexpr (NBc == 4) {
            _mm_storeu_ps(res + i * NB, v_reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
        } else {
            for (int j = 0; j < NBc; ++j) res[i * NB + j] = v_reduce(acc[i][j]);
        }
    }
}

#if defined(DART_V16_AVX2)
// The AVX2 wide shape: ONE weight row against R <= 6 input rows, the contract's 16 lanes as (lo, hi)
// ymm pairs. Written out with named accumulators because GCC kept linear_block's V16 acc[6][1] on the
// stack (a load and a store around every fma: a 6-row verify ran at half the fma rate).
template <class F, int R>
void linear_row_avx2(const float* xf, int64_t K, const uint8_t* w, float* res, const uint8_t* pf) {
    static_assert(R >= 1 && R <= 6, "12 accumulators + 2 weights of 16 ymm registers");
    constexpr int64_t PF = prefetch_every<F>();
    __m256 a0l = _mm256_setzero_ps(), a0h = a0l, a1l = a0l, a1h = a0l, a2l = a0l, a2h = a0l, a3l = a0l, a3h = a0l,
           a4l = a0l, a4h = a0l, a5l = a0l, a5h = a0l;
    const int64_t full = K / LANES * LANES;
#define DART_ROW(i, xl, xh)                                                    \
    if constexpr (R > i) {                                                     \
        a##i##l = _mm256_fmadd_ps(xl, wv.lo, a##i##l);                         \
        a##i##h = _mm256_fmadd_ps(xh, wv.hi, a##i##h);                         \
    }
#define DART_ROWS(XL, XH) DART_ROW(0, XL(0), XH(0)) DART_ROW(1, XL(1), XH(1)) DART_ROW(2, XL(2), XH(2)) \
                          DART_ROW(3, XL(3), XH(3)) DART_ROW(4, XL(4), XH(4)) DART_ROW(5, XL(5), XH(5))
    for (int64_t k = 0; k < full; k += LANES) {
        const V16 wv = w_load16<F>(w, k);
        if (pf && k % PF == 0) prefetch_l2(pf + k * F::BYTES / F::BLOCK);
#define DART_XL(i) _mm256_loadu_ps(xf + (i) * K + k)
#define DART_XH(i) _mm256_loadu_ps(xf + (i) * K + k + 8)
        DART_ROWS(DART_XL, DART_XH)
#undef DART_XL
#undef DART_XH
    }
    if (full < K) {  // zero-filled tail lanes add +0 products (see linear_block)
        const int64_t rem = K - full;
        const V16 wv = v_load_tail(reinterpret_cast<const typename F::T*>(w) + full, rem);
        V16 xt[R];
        for (int i = 0; i < R; ++i) xt[i] = v_load_tail(xf + i * K + full, rem);
#define DART_XL(i) xt[(i) < R ? (i) : 0].lo
#define DART_XH(i) xt[(i) < R ? (i) : 0].hi
        DART_ROWS(DART_XL, DART_XH)
#undef DART_XL
#undef DART_XH
    }
#undef DART_ROWS
#undef DART_ROW
    const V16 acc[6] = {{a0l, a0h}, {a1l, a1h}, {a2l, a2h}, {a3l, a3h}, {a4l, a4h}, {a5l, a5h}};
    for (int i = 0; i < R; ++i) res[i * NB] = v_reduce(acc[i]);
}
#endif

#if defined(DART_V16_AVX2)
// Half h (elements 16h..16h+15) of a block of a block format as fp32 lanes: the values w_load32 gives.
template <class F> inline V16 w_half(const uint8_t* blk, int h) {
    const __m256 d = _mm256_set1_ps(f16_at(blk));
    if constexpr (std::is_same_v<F, FmtQ8_0>) {
        const V16 q = v_i8(blk + 2 + 16 * h);
        return {_mm256_mul_ps(q.lo, d), _mm256_mul_ps(q.hi, d)};
    } else {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (std::is_same_v<F, FmtQ4_1> ? 4 : 2)));
        const __m128i n = _mm_and_si128(h ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(0x0F));
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(n)), q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(n, n)));
        if constexpr (std::is_same_v<F, FmtQ4_1>) {
            const __m256 m = _mm256_set1_ps(f16_at(blk + 2));
            return {_mm256_fmadd_ps(q0, d, m), _mm256_fmadd_ps(q1, d, m)};
        } else {
            const __m256 eight = _mm256_set1_ps(8.0f);
            return {_mm256_mul_ps(_mm256_sub_ps(q0, eight), d), _mm256_mul_ps(_mm256_sub_ps(q1, eight), d)};
        }
    }
}
// Block formats against R <= 6 rows: ONE weight row at a time, each half block dequantized in
// registers and met by every row (12 accumulators + 2 weights of 16 ymm), weight rows [n0, n1) in
// one call (K is small here, 576 or 1536: a call, a dequantized panel and a dispatch per weight row
// cost as much as its arithmetic). Lane order as linear_block's: per block, elements 0-15 then 16-31.
// Against the panel path, the embedded model's Q4_1 forward after 200 tokens (forced AVX2 on the
// Xeon, medians of 3 interleaved processes): 3 rows 18.5 -> 14.1 ms, 4 rows 19.5 -> 15.4, 6 rows
// 28.2 -> 21.3.
template <class F, int R>
void linear_rows_q_avx2(const float* xf, int64_t K, const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, int64_t N, float* res) {
    static_assert(R >= 1 && R <= 6, "12 accumulators + 2 weights of 16 ymm registers");
    constexpr int64_t PF = prefetch_every<F>();
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* wr = w + n * rb;
        const uint8_t* pf = n + PREFETCH_BLOCKS < N ? w + (n + PREFETCH_BLOCKS) * rb : nullptr;
        __m256 a0l = _mm256_setzero_ps(), a0h = a0l, a1l = a0l, a1h = a0l, a2l = a0l, a2h = a0l, a3l = a0l, a3h = a0l,
               a4l = a0l, a4h = a0l, a5l = a0l, a5h = a0l;
        for (int64_t k = 0; k < K; k += 32) {
            const uint8_t* blk = wr + (k / 32) * F::BYTES;
            if (pf && k % PF == 0) prefetch_l2(pf + (k / 32) * F::BYTES);
            for (int h = 0; h < 2; ++h) {
                const V16 wv = w_half<F>(blk, h);
                const int64_t kk = k + 16 * h;
#define DART_ROW(i)                                                                      \
    if constexpr (R > i) {                                                               \
        a##i##l = _mm256_fmadd_ps(_mm256_loadu_ps(xf + (i) * K + kk), wv.lo, a##i##l);   \
        a##i##h = _mm256_fmadd_ps(_mm256_loadu_ps(xf + (i) * K + kk + 8), wv.hi, a##i##h); \
    }
                DART_ROW(0) DART_ROW(1) DART_ROW(2) DART_ROW(3) DART_ROW(4) DART_ROW(5)
#undef DART_ROW
            }
        }
        float* r = res + (n - n0) * R;
        const V16 acc[6] = {{a0l, a0h}, {a1l, a1h}, {a2l, a2h}, {a3l, a3h}, {a4l, a4h}, {a5l, a5h}};
        for (int i = 0; i < R; ++i) r[i] = v_reduce(acc[i]);
    }
}
// Float formats against 3-6 rows: linear_row_avx2's arithmetic over weight rows [n0, n1) in one call
// (bf16 forward after 200 tokens: 3 rows 16.2 -> 15.7 ms, 6 rows 23.6 -> 22.4, as above).
template <class F, int R>
void linear_rows_f_avx2(const float* xf, int64_t K, const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, int64_t N, float* res) {
    static_assert(!F::QUANT && R >= 1 && R <= 6, "float formats; 12 accumulators + 2 weights of 16 ymm registers");
    constexpr int64_t PF = prefetch_every<F>();
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* wr = w + n * rb;
        const uint8_t* pf = n + PREFETCH_BLOCKS < N ? w + (n + PREFETCH_BLOCKS) * rb : nullptr;
        __m256 a0l = _mm256_setzero_ps(), a0h = a0l, a1l = a0l, a1h = a0l, a2l = a0l, a2h = a0l, a3l = a0l, a3h = a0l,
               a4l = a0l, a4h = a0l, a5l = a0l, a5h = a0l;
        const int64_t full = K / LANES * LANES;
#define DART_ROW(i, XL, XH)                                  \
    if constexpr (R > i) {                                   \
        a##i##l = _mm256_fmadd_ps(XL(i), wv.lo, a##i##l);    \
        a##i##h = _mm256_fmadd_ps(XH(i), wv.hi, a##i##h);    \
    }
        for (int64_t k = 0; k < full; k += LANES) {
            const V16 wv = w_load16<F>(wr, k);
            if (pf && k % PF == 0) prefetch_l2(pf + k * F::BYTES);
#define DART_XL(i) _mm256_loadu_ps(xf + (i) * K + k)
#define DART_XH(i) _mm256_loadu_ps(xf + (i) * K + k + 8)
            DART_ROW(0, DART_XL, DART_XH) DART_ROW(1, DART_XL, DART_XH) DART_ROW(2, DART_XL, DART_XH)
            DART_ROW(3, DART_XL, DART_XH) DART_ROW(4, DART_XL, DART_XH) DART_ROW(5, DART_XL, DART_XH)
#undef DART_XL
#undef DART_XH
        }
        if (full < K) {  // zero-filled tail lanes add +0 products (see linear_block)
            const int64_t rem = K - full;
            const V16 wv = v_load_tail(reinterpret_cast<const typename F::T*>(wr) + full, rem);
            V16 xt[R];
            for (int i = 0; i < R; ++i) xt[i] = v_load_tail(xf + i * K + full, rem);
#define DART_XL(i) xt[(i) < R ? (i) : 0].lo
#define DART_XH(i) xt[(i) < R ? (i) : 0].hi
            DART_ROW(0, DART_XL, DART_XH) DART_ROW(1, DART_XL, DART_XH) DART_ROW(2, DART_XL, DART_XH)
            DART_ROW(3, DART_XL, DART_XH) DART_ROW(4, DART_XL, DART_XH) DART_ROW(5, DART_XL, DART_XH)
#undef DART_XL
#undef DART_XH
        }
#undef DART_ROW
        float* r = res + (n - n0) * R;
        const V16 acc[6] = {{a0l, a0h}, {a1l, a1h}, {a2l, a2h}, {a3l, a3h}, {a4l, a4h}, {a5l, a5h}};
        for (int i = 0; i < R; ++i) r[i] = v_reduce(acc[i]);
    }
}
template <class F, int R>
inline void linear_rows_avx2(const float* xf, int64_t K, const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, int64_t N, float* res) {
    if constexpr (F::QUANT) linear_rows_q_avx2<F, R>(xf, K, w, rb, n0, n1, N, res);
    else linear_rows_f_avx2<F, R>(xf, K, w, rb, n0, n1, N, res);
}
// 1-6 rows, every format: one weight row at a time, its lines read in order. 1-2 rows ran 4 or 2
// weight rows at a time from 5b749e3 (more FMA chains in flight), which measured faster in registers
// but slower from memory: on a 2-core AMD EPYC (AVX2 only, every other process paused, interleaved
// processes, three each) one weight row at a time took the bf16 one-row step from 14.8 to 12.6 ms
// (two rows 15.3 -> 13.4) and the exact GGUF path's from 12.1 to 10.8 (two rows 14.7 -> 13.2), and
// the one-row bf16 step no longer cost more than three rows.
constexpr int64_t Q_CHUNK = 16;  // weight rows per call of linear_rows_avx2
template <class TX, class F>
void linear_rows_chunked_avx2(const float* xf, int64_t M, int64_t K, const uint8_t* w, int64_t rb, int64_t N, const TX* bias, TX* out,
                        int64_t out_stride) {
    const int64_t chunks = (N + Q_CHUNK - 1) / Q_CHUNK;
#pragma omp parallel
    {
        float res[Q_CHUNK * 6];
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t n0 = c * Q_CHUNK, n1 = std::min(N, n0 + Q_CHUNK);
            switch (M) {
                case 1: linear_rows_avx2<F, 1>(xf, K, w, rb, n0, n1, N, res); break;
                case 2: linear_rows_avx2<F, 2>(xf, K, w, rb, n0, n1, N, res); break;
                case 3: linear_rows_avx2<F, 3>(xf, K, w, rb, n0, n1, N, res); break;
                case 4: linear_rows_avx2<F, 4>(xf, K, w, rb, n0, n1, N, res); break;
                case 5: linear_rows_avx2<F, 5>(xf, K, w, rb, n0, n1, N, res); break;
                case 6: linear_rows_avx2<F, 6>(xf, K, w, rb, n0, n1, N, res); break;
            }
            for (int64_t n = n0; n < n1; ++n)
                for (int64_t i = 0; i < M; ++i) {
                    float v = res[(n - n0) * M + i];
                    if (bias) v = v + to_f32(bias[n]);
                    out[i * out_stride + n] = from_f32<TX>(v);
                }
        }
    }
}
#endif

template <class F>
void run_block(const float* xf, int64_t K, int64_t mb, const uint8_t* w, int64_t rb, float* res, const uint8_t* pf, bool wide) {
#if defined(DART_V16_AVX2)
    if constexpr (!F::QUANT) {  // block formats reach here as their dequantized fp32 panel
        if (wide) {
            switch (mb) {
                case 1: return linear_row_avx2<F, 1>(xf, K, w, res, pf);
                case 2: return linear_row_avx2<F, 2>(xf, K, w, res, pf);
                case 3: return linear_row_avx2<F, 3>(xf, K, w, res, pf);
                case 4: return linear_row_avx2<F, 4>(xf, K, w, res, pf);
                case 5: return linear_row_avx2<F, 5>(xf, K, w, res, pf);
                case 6: return linear_row_avx2<F, 6>(xf, K, w, res, pf);
            }
        }
    }
#endif
    if constexpr (WIDE_MB == 8) {
        if (wide) {
            switch (mb) {
                case 5: return linear_block<F, 5, WIDE_NB>(xf, K, w, rb, res, pf);
                case 6: return linear_block<F, 6, WIDE_NB>(xf, K, w, rb, res, pf);
                case 7: return linear_block<F, 7, WIDE_NB>(xf, K, w, rb, res, pf);
                case 8: return linear_block<F, 8, WIDE_NB>(xf, K, w, rb, res, pf);
            }
        }
    }
    // AVX2 runs no narrow block: 1-6 rows go to linear_rows_chunked_avx2 and more run wide row blocks.
    if constexpr (MBV >= 4) {
        switch (mb) {
            case 1: return linear_block<F, 1, NBV>(xf, K, w, rb, res, pf);
            case 2: return linear_block<F, 2, NBV>(xf, K, w, rb, res, pf);
            case 3: return linear_block<F, 3, NBV>(xf, K, w, rb, res, pf);
            case 4: return linear_block<F, 4, NBV>(xf, K, w, rb, res, pf);
        }
    }
    throw std::logic_error("linear: bad row block");
}

// The nbv rows of a weight block as fp32, for verifies of more rows than one register block: each
// block is dequantized once (into L1) instead of once per row block, with the same values.
template <class F> void dequant_panel(const uint8_t* w, int64_t rb, int64_t K, int64_t nbv, float* out, const uint8_t* pf) {
    constexpr int64_t PF = prefetch_every<F>();
    for (int64_t k = 0; k < K; k += 32) {
        if (pf && k % PF == 0)
            for (int64_t j = 0; j < nbv; ++j) prefetch_l2(pf + j * rb + k * F::BYTES / F::BLOCK);
        for (int64_t j = 0; j < nbv; ++j) {
            V16 lo, hi;
            w_load32<F>(w + j * rb, k, lo, hi);
            v_store(out + j * K + k, lo);
            v_store(out + j * K + k + 16, hi);
        }
    }
}

template <class TX, class F>
void linear_impl(const TX* x, int64_t x_stride, int64_t M, int64_t K, const uint8_t* w, int64_t rb, int64_t N, const TX* bias,
                 TX* out, int64_t out_stride) {
    std::vector<float> xf(static_cast<size_t>(M * K));
    for (int64_t m = 0; m < M; ++m) load_row(x + m * x_stride, xf.data() + m * K, K);
#if defined(DART_V16_AVX2)
    const bool wide = M > MBV;  // every format, in row blocks of up to WIDE_MB
    const bool panel = F::QUANT && wide;  // block formats: dequantize each weight row once into L1
#else
    const bool wide = F::QUANT && M > MBV && M <= WIDE_MB;
    const bool panel = F::QUANT && M > (wide ? WIDE_MB : MBV);  // dequantize each block once into L1 for all row blocks
#endif
    const int64_t nbv = wide ? WIDE_NB : NBV, mbv = wide ? WIDE_MB : MBV;
    const int64_t blocks = (N + nbv - 1) / nbv;
#if defined(DART_V16_AVX2)
    if (M <= WIDE_MB) return linear_rows_chunked_avx2<TX, F>(xf.data(), M, K, w, rb, N, bias, out, out_stride);
#endif
#pragma omp parallel
    {
        std::vector<float> pbuf(panel ? static_cast<size_t>(nbv * K) : 0);
        std::vector<uint8_t> wpad;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t n0 = b * nbv, nb = std::min(nbv, N - n0);
            const uint8_t* wb = w + n0 * rb;
            if (nb < nbv) {  // the last rows, zero-padded (zero bytes read as 0.0 in every format); their results are dropped
                wpad.assign(static_cast<size_t>(nbv * rb), 0);
                std::memcpy(wpad.data(), wb, nb * rb);
                wb = wpad.data();
            }
            const uint8_t* pf = (b + PREFETCH_BLOCKS + 1) * nbv <= N ? w + (b + PREFETCH_BLOCKS) * nbv * rb : nullptr;
            if (panel) dequant_panel<F>(wb, rb, K, nbv, pbuf.data(), pf);
            float res[WIDE_MB * NB];
            for (int64_t m0 = 0, r = 0; m0 < M; m0 += row_block(M, r++, mbv)) {
                const int64_t mb = row_block(M, r, mbv);
                if (panel)
                    run_block<FmtF32>(xf.data() + m0 * K, K, mb, reinterpret_cast<const uint8_t*>(pbuf.data()), K * 4, res, nullptr, wide);
                else
                    run_block<F>(xf.data() + m0 * K, K, mb, wb, rb, res, m0 == 0 ? pf : nullptr, wide);
                for (int64_t i = 0; i < mb; ++i)
                    for (int64_t j = 0; j < nb; ++j) {
                        float v = res[i * NB + j];
                        if (bias) v = v + to_f32(bias[n0 + j]);
                        out[(m0 + i) * out_stride + n0 + j] = from_f32<TX>(v);
                    }
            }
        }
    }
}
#else
// Generic build: each weight row dequantized once into fp32, then the contract's lane loops.
template <class TX, class F>
void linear_impl(const TX* x, int64_t x_stride, int64_t M, int64_t K, const uint8_t* w, int64_t rb, int64_t N, const TX* bias,
                 TX* out, int64_t out_stride) {
    std::vector<float> xf(static_cast<size_t>(M * K));
    for (int64_t m = 0; m < M; ++m) load_row(x + m * x_stride, xf.data() + m * K, K);
#pragma omp parallel
    {
        std::vector<float> wf(static_cast<size_t>(K));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            if (n + PREFETCH_BLOCKS * NB < N)
                for (int64_t o = 0; o < rb; o += 64) prefetch_l2(w + (n + PREFETCH_BLOCKS * NB) * rb + o);
            dequant_row<F>(w + n * rb, K, wf.data());
            for (int64_t m = 0; m < M; ++m) {
                float v = dot(xf.data() + m * K, wf.data(), K);
                if (bias) v = v + to_f32(bias[n]);
                out[m * out_stride + n] = from_f32<TX>(v);
            }
        }
    }
}
#endif

// ------------------------------------------------------------------------------------- int8 activations
// GGUF block weights against activations quantized to int8 blocks of 32, as llama.cpp multiplies them
// (its Q8_0 / Q8_1 activations): the weights' integer codes meet the activations' in integer dot
// products (AVX-512 VNNI vpdpbusd, or maddubs + madd), so a block is never converted to floats. For
// one row that is ~3x less arithmetic than dequantizing to fp32 (the fp32 path spends most of a GGUF
// step widening nibbles), so a step can run at the speed of its memory traffic. Not exact against the
// fp32 model (activations are rounded to 8 bits per block), but still one fixed sequence per output
// element that depends only on its own row, so a verified tree gives every row the bits of a one-token
// step and greedy decoding stays lossless on this path.
//
// Contract (q8): an activation row is quantized per block b of 32: amax = max|x|, dx = amax / 127,
// id = 1 / dx (0 if dx is 0), q = nearbyint(x * id) (ties to even), sx = dx * sum(q). A weight block's
// integer codes u (Q4_1: the nibble; Q4_0: nibble - 8; Q8_0: q) give exact int32 partial sums
// p(b, l) = sum_{j<4} u[4l+j] q[4l+j], l < 8. Lane (b % 2) * 8 + l of a 16-lane accumulator takes
// fma(d_b * dx_b, float(p(b, l)), lane) in block order; Q4_1's minimum goes to lane b % 16 of a second
// one as fma(m_b, sx_b, lane). The result is reduce(acc) (+ reduce(min)), reduce the contract's tree.
// A zmm holds two blocks (lanes 0-7 and 8-15), an AVX2 V16 the same as two ymm, the generic build
// loops the same lanes: all builds give the same bits (integer sums are exact, and in the same lanes).

constexpr int64_t Q8_ACT = 16;  // flag on a weight format code: multiply against int8 activations
// Flag on an interleaved weight's format code: multiply against 16-bit activations, held as two int8
// digits (contract q16 below), ~256x finer than int8 at twice the integer dot products.
constexpr int64_t Q16_ACT = 32;

// Contract (q16): amax as in q8, dx = amax / Q16_MAX, Q = nearbyint(x / dx) clamped to +-Q16_MAX,
// split into digits hi = nearbyint(float(Q) / 255) and lo = Q - 255 hi, both in [-127, 127] (Q / 255
// is never within 0.002 of a tie, so the fp32 quotient rounds to the exact nearest integer). The
// integer sum of a block is 255 * sum(code * hi) + sum(code * lo) = sum(code * Q), exact in int32,
// and meets the weight scales exactly as q8's does (sx = dx * sum Q): the q8 contract on Q.
constexpr float Q16_MAX = 32512.0f;  // 255 * 127 + 127: the largest Q two digits of [-127, 127] hold
constexpr int32_t Q16_BASE = 255;

struct Q8Rows {  // M activation rows in int8 blocks; pairs of blocks padded with a zero block
    int64_t K = 0, nb = 0, npair = 0, nb16 = 0;
    int digits = 1;           // 1: int8 codes in q; 2: 16-bit codes, high digits in q, low digits in q2
    std::vector<int8_t> q;    // M x (npair * 64)
    std::vector<int8_t> q2;   // digits == 2: the low digits, laid out as q
    std::vector<float> dx16;  // M x npair x 16: the pair's scales, each repeated over its 8 lanes
    std::vector<float> sx;    // M x nb16 (zero past nb)
    std::vector<int32_t> isum;  // M x nb: each block's sum of codes (sx = dx * isum)
    const int8_t* qrow(int64_t m) const { return q.data() + m * npair * 64; }
    const int8_t* qrow2(int64_t m) const { return q2.data() + m * npair * 64; }
    const float* dxrow(int64_t m) const { return dx16.data() + m * npair * 16; }
    const float* sxrow(int64_t m) const { return sx.data() + m * nb16; }
    const int32_t* isrow(int64_t m) const { return isum.data() + m * nb; }
};

#if defined(DART_V16_AVX512) || defined(DART_V16_AVX2)
#define DART_X86_Q8_VEC 1
// One block of quantize_q8 in vector registers, the same bits as its scalar loop: the maximum is
// order-free (max_ps(|v|, running) returns its second operand when |v| is NaN: skipped, as the
// scalar std::max skips it), the scale and its inverse are the same scalar divisions, rounding is
// round-to-nearest-even like nearbyint, and the code sum is integer. It ran serially before every
// int8 linear at ~3 ns an element, ~0.3 ms of each row of a 30-layer forward.
inline bool quantize_block_vec(const float* v, Q8Rows& r, int64_t m, int64_t b) {
#if defined(DART_V16_AVX512)
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512 a = _mm512_loadu_ps(v), c = _mm512_loadu_ps(v + 16);
    const __m512 mx = _mm512_max_ps(_mm512_andnot_ps(sign, c), _mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_setzero_ps()));
    float lanes[16];
    _mm512_storeu_ps(lanes, mx);
#else
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 a0 = _mm256_loadu_ps(v), a1 = _mm256_loadu_ps(v + 8), a2 = _mm256_loadu_ps(v + 16), a3 = _mm256_loadu_ps(v + 24);
    __m256 mx = _mm256_setzero_ps();
    for (__m256 t : {a0, a1, a2, a3}) mx = _mm256_max_ps(_mm256_andnot_ps(sign, t), mx);
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
#endif
    float amax = 0.0f;
    for (float l : lanes) amax = std::max(amax, l);
    const bool wide = r.digits == 2;
    const float qmax = wide ? Q16_MAX : 127.0f;
    const float d = amax / qmax, id = d != 0.0f ? 1.0f / d : 0.0f;
    int8_t* q = r.q.data() + m * r.npair * 64 + b * 32;
    int8_t* q2 = wide ? r.q2.data() + m * r.npair * 64 + b * 32 : nullptr;
    int32_t s = 0;
#if defined(DART_V16_AVX512)
    const __m512 vid = _mm512_set1_ps(id), hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
    for (int h = 0; h < 2; ++h) {
        const __m512 x = _mm512_loadu_ps(v + 16 * h);
        __m512 t = _mm512_roundscale_ps(_mm512_mul_ps(x, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(t, t, _CMP_ORD_Q), _mm512_min_ps(_mm512_max_ps(t, lo), hi));
        const __m512i ti = _mm512_cvtps_epi32(t);
        s += _mm512_reduce_add_epi32(ti);
        if (!wide) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(ti));
            continue;
        }
        const __m512 th = _mm512_roundscale_ps(_mm512_div_ps(t, _mm512_set1_ps(static_cast<float>(Q16_BASE))),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i dh = _mm512_cvtps_epi32(th);
        const __m512i dl = _mm512_sub_epi32(ti, _mm512_sub_epi32(_mm512_slli_epi32(dh, 8), dh));  // Q - 255 hi
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(dh));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + 16 * h), _mm512_cvtepi32_epi8(dl));
    }
#else
    const __m256 vid = _mm256_set1_ps(id), hi = _mm256_set1_ps(qmax), lo = _mm256_set1_ps(-qmax);
    for (int h = 0; h < 4; ++h) {
        const __m256 x = _mm256_loadu_ps(v + 8 * h);
        __m256 t = _mm256_round_ps(_mm256_mul_ps(x, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm256_and_ps(_mm256_cmp_ps(t, t, _CMP_ORD_Q), _mm256_min_ps(_mm256_max_ps(t, lo), hi));
        const __m256i ti = _mm256_cvtps_epi32(t);
        alignas(32) int32_t w[8], wh[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(w), ti);
        if (wide) {
            const __m256 th = _mm256_round_ps(_mm256_div_ps(t, _mm256_set1_ps(static_cast<float>(Q16_BASE))),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm256_store_si256(reinterpret_cast<__m256i*>(wh), _mm256_cvtps_epi32(th));
        }
        for (int e = 0; e < 8; ++e) {
            s += w[e];
            if (wide) q[8 * h + e] = static_cast<int8_t>(wh[e]), q2[8 * h + e] = static_cast<int8_t>(w[e] - Q16_BASE * wh[e]);
            else q[8 * h + e] = static_cast<int8_t>(w[e]);
        }
    }
#endif
    float* dx = r.dx16.data() + m * r.npair * 16 + (b / 2) * 16 + (b % 2) * 8;
    for (int l = 0; l < 8; ++l) dx[l] = d;
    r.sx[m * r.nb16 + b] = d * static_cast<float>(s);
    r.isum[m * r.nb + b] = s;
    return true;
}
#endif

template <class TX>
void quantize_q8(const TX* x, int64_t x_stride, int64_t M, int64_t K, Q8Rows& r, int digits = 1) {
    r.K = K, r.nb = K / 32, r.npair = (r.nb + 1) / 2, r.nb16 = (r.nb + 15) / 16 * 16, r.digits = digits;
    r.q.assign(static_cast<size_t>(M * r.npair * 64), 0);
    r.q2.assign(digits == 2 ? static_cast<size_t>(M * r.npair * 64) : 0, 0);
    r.dx16.assign(static_cast<size_t>(M * r.npair * 16), 0.0f);
    r.sx.assign(static_cast<size_t>(M * r.nb16), 0.0f);
    r.isum.assign(static_cast<size_t>(M * r.nb), 0);
    std::vector<float> row(static_cast<size_t>(K));
    for (int64_t m = 0; m < M; ++m) {
        load_row(x + m * x_stride, row.data(), K);
        for (int64_t b = 0; b < r.nb; ++b) {
            const float* v = row.data() + b * 32;
#ifdef DART_X86_Q8_VEC
            if (quantize_block_vec(v, r, m, b)) continue;
#endif
            float amax = 0.0f;
            for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
            const float qmax = digits == 2 ? Q16_MAX : 127.0f;
            const float d = amax / qmax, id = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t s = 0;
            int8_t* q = r.q.data() + m * r.npair * 64 + b * 32;
            int8_t* q2 = digits == 2 ? r.q2.data() + m * r.npair * 64 + b * 32 : nullptr;
            for (int i = 0; i < 32; ++i) {
                float t = std::nearbyint(v[i] * id);
                t = t > qmax ? qmax : (t < -qmax ? -qmax : (t == t ? t : 0.0f));
                const int32_t c = static_cast<int32_t>(t);
                s += c;
                if (digits == 1) {
                    q[i] = static_cast<int8_t>(c);
                    continue;
                }
                const int32_t h = static_cast<int32_t>(std::nearbyint(t / static_cast<float>(Q16_BASE)));
                q[i] = static_cast<int8_t>(h);
                q2[i] = static_cast<int8_t>(c - Q16_BASE * h);
            }
            float* dx = r.dx16.data() + m * r.npair * 16 + (b / 2) * 16 + (b % 2) * 8;
            for (int l = 0; l < 8; ++l) dx[l] = d;
            r.sx[m * r.nb16 + b] = d * static_cast<float>(s);
            r.isum[m * r.nb + b] = s;
        }
    }
}

// A block's scale, minimum (Q4_1; Q4_0's -8 is in its codes) and its 32 integer codes.
template <class F> constexpr bool q8_signed() { return !std::is_same_v<F, FmtQ4_1>; }
template <class F> inline const uint8_t* q8_codes_at(const uint8_t* blk) { return blk + (std::is_same_v<F, FmtQ4_1> ? 4 : 2); }

template <class F> inline void q8_codes_scalar(const uint8_t* blk, int32_t* c) {
    const uint8_t* p = q8_codes_at<F>(blk);
    if constexpr (std::is_same_v<F, FmtQ8_0>) {
        for (int i = 0; i < 32; ++i) c[i] = static_cast<int8_t>(p[i]);
    } else {
        const int32_t off = std::is_same_v<F, FmtQ4_0> ? 8 : 0;
        for (int i = 0; i < 16; ++i) c[i] = (p[i] & 15) - off, c[i + 16] = (p[i] >> 4) - off;
    }
}

// One output element of the q8 contract, lane by lane (the generic build, and the reference).
template <class F> float q8_dot_ref(const Q8Rows& x, int64_t m, const uint8_t* wrow) {
    float acc[LANES] = {0}, mins[LANES] = {0};
    const int8_t* xq = x.qrow(m);
    for (int64_t b = 0; b < x.nb; ++b) {
        const uint8_t* blk = wrow + b * F::BYTES;
        int32_t c[32];
        q8_codes_scalar<F>(blk, c);
        const float s = f16_at(blk) * x.dxrow(m)[(b / 2) * 16 + (b % 2) * 8];
        for (int l = 0; l < 8; ++l) {
            int32_t p = 0;
            for (int j = 0; j < 4; ++j) p += c[4 * l + j] * xq[b * 32 + 4 * l + j];
            float& a = acc[(b % 2) * 8 + l];
            a = std::fma(s, static_cast<float>(p), a);
        }
        if constexpr (std::is_same_v<F, FmtQ4_1>) mins[b % 16] = std::fma(f16_at(blk + 2), x.sxrow(m)[b], mins[b % 16]);
    }
    const float r = reduce_lanes(acc);
    if constexpr (std::is_same_v<F, FmtQ4_1>) return r + reduce_lanes(mins);
    return r;
}

#ifdef DART_V16
#if defined(DART_V16_AVX512)
// A pair of weight blocks' codes: unsigned bytes (|code| for the signed formats) and which activation
// bytes to negate (the signed formats' negative codes), so u * x' = code * x in unsigned x signed products.
struct W64 {
    __m512i u;
    __mmask64 neg;
};
inline __m256i nibbles32(const uint8_t* p) {  // 16 bytes -> [low nibbles | high nibbles] as 32 bytes
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1), _mm256_set1_epi8(0x0F));
}
template <class F> inline __m256i codes32(const uint8_t* blk) {
    if constexpr (std::is_same_v<F, FmtQ8_0>) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    else if constexpr (std::is_same_v<F, FmtQ4_0>) return _mm256_sub_epi8(nibbles32(blk + 2), _mm256_set1_epi8(8));
    else return nibbles32(blk + 4);
}
template <class F> inline W64 w_pair(const uint8_t* a, const uint8_t* b /* nullptr: a zero block */) {
    const __m256i ca = codes32<F>(a), cb = b ? codes32<F>(b) : _mm256_setzero_si256();
    const __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(ca), cb, 1);
    if constexpr (q8_signed<F>()) return {_mm512_abs_epi8(c), _mm512_movepi8_mask(c)};
    else return {c, 0};
}
template <class F> inline V16 dot_pair(const W64& w, const int8_t* xp) {
    __m512i x = _mm512_loadu_si512(xp);
    if constexpr (q8_signed<F>()) x = _mm512_mask_sub_epi8(x, w.neg, _mm512_setzero_si512(), x);
#ifdef __AVX512VNNI__
    const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.u, x);
#else
    const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(w.u, x), _mm512_set1_epi16(1));
#endif
    return {_mm512_cvtepi32_ps(p)};
}
inline V16 pair_scales(float a, float b) { return {_mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1)}; }
#else  // AVX2: the two blocks of a pair in two ymm (lanes 0-7 | 8-15)
struct W64 {
    __m256i u0, u1, s0, s1;  // |codes|, and the signed codes whose signs go onto the activations
};
inline __m256i nibbles32(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1), _mm256_set1_epi8(0x0F));
}
template <class F> inline __m256i codes32(const uint8_t* blk) {
    if constexpr (std::is_same_v<F, FmtQ8_0>) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    else if constexpr (std::is_same_v<F, FmtQ4_0>) return _mm256_sub_epi8(nibbles32(blk + 2), _mm256_set1_epi8(8));
    else return nibbles32(blk + 4);
}
template <class F> inline W64 w_pair(const uint8_t* a, const uint8_t* b) {
    const __m256i ca = codes32<F>(a), cb = b ? codes32<F>(b) : _mm256_setzero_si256();
    if constexpr (q8_signed<F>()) return {_mm256_sign_epi8(ca, ca), _mm256_sign_epi8(cb, cb), ca, cb};
    else return {ca, cb, ca, cb};
}
template <class F> inline V16 dot_pair(const W64& w, const int8_t* xp) {
    __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp)), x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32));
    if constexpr (q8_signed<F>()) x0 = _mm256_sign_epi8(x0, w.s0), x1 = _mm256_sign_epi8(x1, w.s1);
    const __m256i one = _mm256_set1_epi16(1);
    return {_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w.u0, x0), one)),
            _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w.u1, x1), one))};
}
inline V16 pair_scales(float a, float b) { return {_mm256_set1_ps(a), _mm256_set1_ps(b)}; }
#endif

// R activation rows x NBc weight rows, a pair of blocks at a time; res [R][NB]. mins: NBc x nb16
// floats of scratch, zero past nb (Q4_1's minimums, gathered on the way for the tail's short dot).
template <class F, int R, int NBc>
void q8_block(const Q8Rows& x, int64_t m0, const uint8_t* w, int64_t rb, float* res, const uint8_t* pf, float* mins) {
    V16 acc[R][NBc];
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < NBc; ++j) acc[i][j] = v_zero();
    const int64_t row_q = x.npair * 64, row_d = x.npair * 16;
    const int8_t* xq = x.qrow(m0);
    const float* xd = x.dxrow(m0);
    for (int64_t p = 0; p < x.npair; ++p) {
        const int64_t b = 2 * p;
        const bool has_b = b + 1 < x.nb;
        W64 wc[NBc];
        V16 dv[NBc];
#pragma GCC unroll 4
        for (int j = 0; j < NBc; ++j) {
            const uint8_t* ba = w + j * rb + b * F::BYTES;
            const uint8_t* bb = has_b ? ba + F::BYTES : nullptr;
            wc[j] = w_pair<F>(ba, bb);
            dv[j] = pair_scales(f16_at(ba), has_b ? f16_at(bb) : 0.0f);
            if constexpr (std::is_same_v<F, FmtQ4_1>) {
                mins[j * x.nb16 + b] = f16_at(ba + 2);
                if (has_b) mins[j * x.nb16 + b + 1] = f16_at(bb + 2);
            }
        }
        if (pf)
            for (int j = 0; j < NBc; ++j) prefetch_l2(pf + j * rb + b * F::BYTES);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
            const V16 dx = v_load(xd + i * row_d + p * 16);
#pragma GCC unroll 4
            for (int j = 0; j < NBc; ++j) acc[i][j] = v_fma(v_mul(dv[j], dx), dot_pair<F>(wc[j], xq + i * row_q + p * 64), acc[i][j]);
        }
    }
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < NBc; ++j) {
            float r = v_reduce(acc[i][j]);
            if constexpr (std::is_same_v<F, FmtQ4_1>) {
                V16 mn = v_zero();
                const float* sx = x.sxrow(m0 + i);
                for (int64_t c = 0; c < x.nb16; c += 16) mn = v_fma(v_load(mins + j * x.nb16 + c), v_load(sx + c), mn);
                r = r + v_reduce(mn);
            }
            res[i * NB + j] = r;
        }
}

#if defined(DART_V16_AVX512)
constexpr int64_t Q8_MB = 12;  // rows per row block: 12 accumulators + weights of 32 zmm
constexpr int q8_nb(int R) { return R <= 4 ? 4 : (R <= 8 ? 2 : 1); }
#else
constexpr int64_t Q8_MB = 4;   // 8 ymm accumulators + 4 weight + 2 scale of 16
constexpr int q8_nb(int R) { return R <= 1 ? 2 : 1; }
#endif

template <class F, int R>
void q8_run(int64_t nbv, const Q8Rows& x, int64_t m0, const uint8_t* w, int64_t rb, float* res, const uint8_t* pf, float* mins) {
    constexpr int A = q8_nb(R), B = q8_nb(R + 1);
    if (nbv == A) return q8_block<F, R, A>(x, m0, w, rb, res, pf, mins);
    if constexpr (B != A) {
        if (nbv == B) return q8_block<F, R, B>(x, m0, w, rb, res, pf, mins);
    }
    throw std::logic_error("linear (int8 activations): bad weight block");
}

template <class F>
void q8_dispatch(int64_t mb, int64_t nbv, const Q8Rows& x, int64_t m0, const uint8_t* w, int64_t rb, float* res, const uint8_t* pf, float* mins) {
    switch (mb) {
#define DART_Q8_CASE(r) \
    case r:             \
        if constexpr (r <= Q8_MB) return q8_run<F, r>(nbv, x, m0, w, rb, res, pf, mins);
        DART_Q8_CASE(1) DART_Q8_CASE(2) DART_Q8_CASE(3) DART_Q8_CASE(4) DART_Q8_CASE(5) DART_Q8_CASE(6)
        DART_Q8_CASE(7) DART_Q8_CASE(8) DART_Q8_CASE(9) DART_Q8_CASE(10) DART_Q8_CASE(11) DART_Q8_CASE(12)
#undef DART_Q8_CASE
    }
    throw std::logic_error("linear (int8 activations): bad row block");
}
#endif

template <class TX, class F>
void linear_q8_impl(const TX* x, int64_t x_stride, int64_t M, int64_t K, const uint8_t* w, int64_t rb, int64_t N, const TX* bias,
                    TX* out, int64_t out_stride) {
    Q8Rows xq;
    quantize_q8(x, x_stride, M, K, xq);
#ifdef DART_V16
    const int64_t mb0 = row_block(M, 0, Q8_MB);
    const int64_t nbv = q8_nb(static_cast<int>(mb0));
    const int64_t blocks = (N + nbv - 1) / nbv;
#pragma omp parallel
    {
        std::vector<float> mins(static_cast<size_t>(nbv * xq.nb16), 0.0f);
        std::vector<uint8_t> wpad;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t n0 = b * nbv, nb = std::min(nbv, N - n0);
            const uint8_t* wb = w + n0 * rb;
            if (nb < nbv) {  // the last rows, zero-padded (a zero block is all zeros); their results are dropped
                wpad.assign(static_cast<size_t>(nbv * rb), 0);
                std::memcpy(wpad.data(), wb, nb * rb);
                wb = wpad.data();
            }
            const uint8_t* pf = (b + PREFETCH_BLOCKS + 1) * nbv <= N ? w + (b + PREFETCH_BLOCKS) * nbv * rb : nullptr;
            float res[Q8_MB * NB];
            for (int64_t m0 = 0, r = 0; m0 < M; m0 += row_block(M, r++, Q8_MB)) {
                const int64_t mb = row_block(M, r, Q8_MB);
                q8_dispatch<F>(mb, nbv, xq, m0, wb, rb, res, m0 == 0 ? pf : nullptr, mins.data());
                for (int64_t i = 0; i < mb; ++i)
                    for (int64_t j = 0; j < nb; ++j) {
                        float v = res[i * NB + j];
                        if (bias) v = v + to_f32(bias[n0 + j]);
                        out[(m0 + i) * out_stride + n0 + j] = from_f32<TX>(v);
                    }
            }
        }
    }
#else
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n)
        for (int64_t m = 0; m < M; ++m) {
            float v = q8_dot_ref<F>(xq, m, w + n * rb);
            if (bias) v = v + to_f32(bias[n]);
            out[m * out_stride + n] = from_f32<TX>(v);
        }
#endif
}

// ------------------------------------------------------------------------------------- int8 activations, rows interleaved
// Q4_0 / Q4_1 weights re-laid out for int8 activations: the same bytes, the blocks of 16 consecutive
// weight rows interleaved so that one integer lane holds one weight row ("x16"). Per group of 16 rows
// and block b: the 16 scales (fp16, 32 bytes), Q4_1's 16 minimums (32 bytes), then 4 chunks of 64
// bytes: chunk j holds bytes 4j..4j+3 of each row's 16 code bytes, row after row. A chunk's low
// nibbles are elements 4j..4j+3 of the 16 rows, its high nibbles elements 16+4j..16+4j+3, so one
// integer dot product against 4 activation bytes broadcast to every lane advances 16 rows by 4
// elements, and 8 of them give each row's whole block sum in its own lane: per block and input row
// 8 dot products, one conversion and 2-3 float ops for 16 outputs, against ~5 instructions per output
// in the layout as stored (whose lanes are elements, reduced at the end). The weights stream as
// many bytes as before. Q8_0 (the LM head) the same way with 8 chunks of its 32 signed code bytes:
// chunk j holds elements 4j..4j+3 of the 16 rows (x16_group_q8_0 below says how signed codes meet
// the unsigned operand of the integer dot product).
//
// Contract (q8x16), per output (weight row n, input row m): acc = 0; for each block b in order:
// acc = fma(d_nb * dx_mb, float(sum_e code * q), acc); then acc = fma(o_nb, sx_mb, acc) with o = m
// (Q4_1) or -8 d (Q4_0, its codes taken unsigned); Q8_0 (signed codes) has no offset term. No lane
// reduction; every build the same bits.

constexpr int64_t X16 = 16;  // weight rows per interleaved group
constexpr int64_t X16_PREFETCH_GROUPS = 2;  // groups ahead (6-15 KB each), into L2
template <class F> constexpr int64_t x16_codes_at() { return std::is_same_v<F, FmtQ4_1> ? 64 : 32; }  // bytes of scales (+ minimums)
template <class F> constexpr int x16_chunks() { return std::is_same_v<F, FmtQ8_0> ? 8 : 4; }  // 64-byte code chunks a block
template <class F> constexpr int64_t x16_block_bytes() { return X16 * F::BYTES; }

// Four code bytes at p (activation codes, or a weight row's bytes of an interleaved chunk) as one word.
inline int32_t code_word(const void* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// Weight row `lane` of an interleaved group's block as its 32 codes (Q4: unsigned nibbles; Q8_0: the
// signed bytes), scale and offset term (Q8_0 has none).
template <class F> inline void x16_block_scalar(const uint8_t* gb, int lane, int32_t* c, float& d, float& o) {
    d = f16_at(gb + 2 * lane);
    o = std::is_same_v<F, FmtQ4_1> ? f16_at(gb + 32 + 2 * lane) : -8.0f * d;
    const uint8_t* codes = gb + x16_codes_at<F>();
    if constexpr (std::is_same_v<F, FmtQ8_0>) {
        o = 0.0f;
        for (int j = 0; j < 8; ++j)
            for (int t = 0; t < 4; ++t) c[4 * j + t] = static_cast<int8_t>(codes[j * 64 + lane * 4 + t]);
        return;
    }
    for (int j = 0; j < 4; ++j)
        for (int t = 0; t < 4; ++t) {
            const uint8_t byte = codes[j * 64 + lane * 4 + t];
            c[4 * j + t] = byte & 15, c[16 + 4 * j + t] = byte >> 4;
        }
}

// Elements [0, K) of weight row `lane` of a group as fp32 (the prefill's dequantization): the values
// dequant_row gives for the same block in the layout as stored.
template <class F> void dequant_row_x16(const uint8_t* group, int lane, int64_t K, float* out) {
#ifdef DART_V16
    // The same values 8 at a time (AVX2 + F16C + FMA, in both vector builds): the row's code bytes are
    // one 32-bit word per chunk, so a block's codes are 4 (Q8_0: 8) scalar loads; then the scalar
    // loop's exact operations (one fma, or one product after an exact integer offset) lane by lane.
    // ~3x the scalar loop's rate; a prompt prefill dequantizes every layer's linears once.
    for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* gb = group + b * x16_block_bytes<F>();
        const uint8_t* codes = gb + x16_codes_at<F>() + 4 * lane;
        const __m256 d = _mm256_set1_ps(f16_at(gb + 2 * lane));
        float* o8 = out + b * 32;
        if constexpr (std::is_same_v<F, FmtQ8_0>) {
            alignas(32) int32_t w[8];
            for (int j = 0; j < 8; ++j) w[j] = code_word(codes + j * 64);
            for (int h = 0; h < 4; ++h) {
                const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 2 * h)));
                _mm256_storeu_ps(o8 + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
            }
        } else {
            const __m128i v = _mm_setr_epi32(code_word(codes), code_word(codes + 64), code_word(codes + 128), code_word(codes + 192));
            const __m128i m4 = _mm_set1_epi8(0x0F);
            const __m128i nib[2] = {_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4)};  // elements 0-15, 16-31
            const __m256 off = _mm256_set1_ps(std::is_same_v<F, FmtQ4_1> ? f16_at(gb + 32 + 2 * lane) : 0.0f);
            for (int h = 0; h < 4; ++h) {
                __m256i q = _mm256_cvtepu8_epi32(h % 2 ? _mm_srli_si128(nib[h / 2], 8) : nib[h / 2]);
                if constexpr (std::is_same_v<F, FmtQ4_1>) {
                    _mm256_storeu_ps(o8 + 8 * h, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), off));
                } else {
                    q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));
                    _mm256_storeu_ps(o8 + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
                }
            }
        }
    }
#else
    for (int64_t b = 0; b < K / 32; ++b) {
        int32_t c[32];
        float d, o;
        x16_block_scalar<F>(group + b * x16_block_bytes<F>(), lane, c, d, o);
        for (int e = 0; e < 32; ++e)
            out[b * 32 + e] = std::is_same_v<F, FmtQ4_1>   ? std::fma(d, static_cast<float>(c[e]), o)
                              : std::is_same_v<F, FmtQ8_0> ? d * static_cast<float>(c[e])
                                                           : d * static_cast<float>(c[e] - 8);
    }
#endif
}

template <class F> float x16_dot_ref(const Q8Rows& x, int64_t m, const uint8_t* group, int lane) {
    float acc = 0.0f;
    const int8_t* xq = x.qrow(m);
    for (int64_t b = 0; b < x.nb; ++b) {
        int32_t c[32];
        float d, o;
        x16_block_scalar<F>(group + b * x16_block_bytes<F>(), lane, c, d, o);
        int32_t p = 0;
        for (int e = 0; e < 32; ++e) p += c[e] * xq[b * 32 + e];
        if (x.digits == 2) {
            int32_t p2 = 0;
            for (int e = 0; e < 32; ++e) p2 += c[e] * x.qrow2(m)[b * 32 + e];
            p = Q16_BASE * p + p2;
        }
        acc = std::fma(d * x.dxrow(m)[(b / 2) * 16 + (b % 2) * 8], static_cast<float>(p), acc);
        if constexpr (!std::is_same_v<F, FmtQ8_0>) acc = std::fma(o, x.sxrow(m)[b], acc);
    }
    return acc;
}

#ifdef DART_V16
// Four activation codes (one 32-bit word, code_word) to every lane, straight from memory: a broadcast
// load, no ALU port. Copying a block's 32 codes to a local array first made GCC move them through
// general registers (a 64-bit load, a shift and a register broadcast per word), and the broadcasts
// competed with the dot products for the vector ports.
#if defined(DART_V16_AVX512)
inline __m512i bcast_word512(const int8_t* p) { return _mm512_set1_epi32(code_word(p)); }
#else
inline __m256i bcast_word256(const int8_t* p) { return _mm256_set1_epi32(code_word(p)); }
#endif

inline float q8_dx(const Q8Rows& x, int64_t m, int64_t b) { return x.dxrow(m)[(b / 2) * 16 + (b % 2) * 8]; }
// q16: a block's integer sum from its two digits' sums, 255 * hi + lo (exact in int32)
#if defined(DART_V16_AVX512)
inline __m512i q16_join(__m512i hi, __m512i lo) { return _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(hi, 8), hi), lo); }
#else
inline __m256i q16_join(__m256i hi, __m256i lo) { return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(hi, 8), hi), lo); }
#endif

#if defined(DART_V16_AVX512)
constexpr int64_t X16_MB = 16;  // input rows per pass: 16 accumulators + 8 code registers + scales of 32
// Q8_0 (the LM head / tied embedding): 8 chunks of signed codes. With VNNI the codes go in as c + 128
// (unsigned, one xor a block for all rows) and 128 * (the activation block's code sum) comes off the
// integer sum; without it, |c| against the activations with c's signs (pair sums <= 2 * 128 * 127,
// exact in int16). Either way the exact integer sum_e c * q of the contract.
template <int R, bool Wide>
void x16_group_q8_0(const Q8Rows& x, int64_t m0, const uint8_t* group, float* res, const uint8_t* pf) {
    constexpr int64_t BB = x16_block_bytes<FmtQ8_0>();
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < x.nb; ++b) {
        const uint8_t* gb = group + b * BB;
        if (pf)
            for (int64_t o = 0; o < BB; o += 64) prefetch_l2(pf + b * BB + o);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb)));
        const uint8_t* codes = gb + x16_codes_at<FmtQ8_0>();
#ifdef __AVX512VNNI__
        __m512i u[8];
        for (int j = 0; j < 8; ++j) u[j] = _mm512_xor_si512(_mm512_loadu_si512(codes + j * 64), _mm512_set1_epi8(static_cast<char>(0x80)));
#endif
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
            const int8_t* xq = x.qrow(m0 + i) + b * 32;
#ifdef __AVX512VNNI__
            auto dot = [&](const int8_t* xp) {
                __m512i p = _mm512_setzero_si512(), p1 = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int j = 0; j < 8; j += 2) {
                    p = _mm512_dpbusd_epi32(p, u[j], bcast_word512(xp + 4 * j));
                    p1 = _mm512_dpbusd_epi32(p1, u[j + 1], bcast_word512(xp + 4 * j + 4));
                }
                return _mm512_add_epi32(p, p1);
            };
            __m512i p = dot(xq);
            if constexpr (Wide) p = q16_join(p, dot(x.qrow2(m0 + i) + b * 32));
            // isum is the block's code sum (q16: of Q), so this takes off 128 * sum Q of the joined digits
            p = _mm512_sub_epi32(p, _mm512_set1_epi32(128 * x.isrow(m0 + i)[b]));
#else
            auto dot = [&](const int8_t* xp) {
                __m512i p = _mm512_setzero_si512();
                for (int j = 0; j < 8; ++j) {
                    const __m512i c = _mm512_loadu_si512(codes + j * 64), xb = bcast_word512(xp + 4 * j);
                    const __m512i xs = _mm512_mask_sub_epi8(xb, _mm512_movepi8_mask(c), _mm512_setzero_si512(), xb);
                    p = _mm512_add_epi32(p, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(c), xs), _mm512_set1_epi16(1)));
                }
                return p;
            };
            __m512i p = dot(xq);
            if constexpr (Wide) p = q16_join(p, dot(x.qrow2(m0 + i) + b * 32));
#endif
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(q8_dx(x, m0 + i, b))), _mm512_cvtepi32_ps(p), acc[i]);
        }
    }
    for (int i = 0; i < R; ++i) _mm512_storeu_ps(res + i * X16, acc[i]);
}

// R input rows against one group of 16 weight rows; out rows out_stride apart (16 outputs each).
template <class F, int R, bool Wide>
void x16_group(const Q8Rows& x, int64_t m0, const uint8_t* group, float* res, const uint8_t* pf) {
    if constexpr (std::is_same_v<F, FmtQ8_0>) return x16_group_q8_0<R, Wide>(x, m0, group, res, pf);
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < x.nb; ++b) {
        const uint8_t* gb = group + b * x16_block_bytes<F>();
        if (pf)  // the same block of a group PREFETCH_BLOCKS ahead, a line at a time between the arithmetic
            for (int64_t o = 0; o < x16_block_bytes<F>(); o += 64) prefetch_l2(pf + b * x16_block_bytes<F>() + o);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb)));
        const __m512 o = std::is_same_v<F, FmtQ4_1> ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 32)))
                                                      : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
        const uint8_t* codes = gb + x16_codes_at<F>();
        __m512i lo[4], hi[4];
        for (int j = 0; j < 4; ++j) {
            const __m512i c = _mm512_loadu_si512(codes + j * 64);
            lo[j] = _mm512_and_si512(c, m4);
            hi[j] = _mm512_and_si512(_mm512_srli_epi16(c, 4), m4);
        }
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
            const int8_t* xq = x.qrow(m0 + i) + b * 32;
#ifdef __AVX512VNNI__
            // two integer accumulators (low and high nibbles): half the dependency chain, the same exact sum
            auto dot = [&](const int8_t* xp) {
                __m512i p = _mm512_setzero_si512(), p1 = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int j = 0; j < 4; ++j) {
                    p = _mm512_dpbusd_epi32(p, lo[j], bcast_word512(xp + 4 * j));
                    p1 = _mm512_dpbusd_epi32(p1, hi[j], bcast_word512(xp + 16 + 4 * j));
                }
                return _mm512_add_epi32(p, p1);
            };
#else
            auto dot = [&](const int8_t* xp) {
                const __m512i one = _mm512_set1_epi16(1);
                __m512i p = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int j = 0; j < 4; ++j)
                    p = _mm512_add_epi32(p, _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(lo[j], bcast_word512(xp + 4 * j)),
                                                                                _mm512_maddubs_epi16(hi[j], bcast_word512(xp + 16 + 4 * j))), one));
                return p;
            };
#endif
            __m512i p = dot(xq);
            if constexpr (Wide) p = q16_join(p, dot(x.qrow2(m0 + i) + b * 32));
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(q8_dx(x, m0 + i, b))), _mm512_cvtepi32_ps(p), acc[i]);
            acc[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(x.sxrow(m0 + i)[b]), acc[i]);
        }
    }
    for (int i = 0; i < R; ++i) _mm512_storeu_ps(res + i * X16, acc[i]);
}
#else  // AVX2: the group as two halves of 8 rows (the first and second 32 bytes of each 64-byte chunk)
constexpr int64_t X16_MB = 6;  // 6 accumulators + 8 code registers + scales of 16 ymm
// Up to this many input rows, a group runs block by block with both halves inside each block (2R
// accumulators), so every 64-byte line is used once, as it arrives; past it, half by half (R
// accumulators, the codes of a block-half in registers), the second half re-reading the group from
// L1. The one-row step is memory-bound, and half by half its demand loads stopped for the whole
// second pass: forced AVX2 on the AMD EPYC, the layers of a one-row gguf-int16 step 5.0 -> 4.3 ms
// and the Q8_0 LM head 1.7 -> 1.3 ms (its memory limit). More rows than this spill the 2R
// accumulators past the 16 ymm registers and run slower fused. Q8_0 keeps no codes in registers.
template <bool Wide> constexpr int x16_fused_rows() { return Wide ? 2 : 3; }
constexpr int X16_FUSED_ROWS_Q8_0 = 6;

// One block-half (8 weight rows) of a Q8_0 group against R input rows, into acc[R]:
// |c| against the activations with c's signs (pair sums exact in int16), a chunk at a time.
template <int R, bool Wide>
inline void x16_half_q8_0(const Q8Rows& x, int64_t m0, int64_t b, const uint8_t* gb, int half, __m256* acc) {
    const __m256i one = _mm256_set1_epi16(1);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 16 * half)));
    const uint8_t* codes = gb + x16_codes_at<FmtQ8_0>() + 32 * half;
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
        const int8_t* xq = x.qrow(m0 + i) + b * 32;
        auto dot = [&](const int8_t* xp) {
            __m256i p = _mm256_setzero_si256();
            for (int j = 0; j < 8; ++j) {
                const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64));
                const __m256i s = _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(bcast_word256(xp + 4 * j), c));
                p = _mm256_add_epi32(p, _mm256_madd_epi16(s, one));
            }
            return p;
        };
        __m256i p = dot(xq);
        if constexpr (Wide) p = q16_join(p, dot(x.qrow2(m0 + i) + b * 32));
        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(q8_dx(x, m0 + i, b))), _mm256_cvtepi32_ps(p), acc[i]);
    }
}

// One block-half of a Q4_0 / Q4_1 group against R input rows, into acc[R].
template <class F, int R, bool Wide>
inline void x16_half_q4(const Q8Rows& x, int64_t m0, int64_t b, const uint8_t* gb, int half, __m256* acc) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi16(1);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 16 * half)));
    const __m256 o = std::is_same_v<F, FmtQ4_1> ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 32 + 16 * half)))
                                                  : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    const uint8_t* codes = gb + x16_codes_at<F>() + 32 * half;
    __m256i lo[4], hi[4];
    for (int j = 0; j < 4; ++j) {
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64));
        lo[j] = _mm256_and_si256(c, m4);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(c, 4), m4);
    }
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
        const int8_t* xq = x.qrow(m0 + i) + b * 32;
        // 16-bit sums of the 8 products pairs: at most 8 * 2 * 15 * 127 = 30480, no saturation
        auto dot = [&](const int8_t* xp) {
            __m256i s = _mm256_maddubs_epi16(lo[0], bcast_word256(xp));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[0], bcast_word256(xp + 16)));
#pragma GCC unroll 3
            for (int j = 1; j < 4; ++j) {
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[j], bcast_word256(xp + 4 * j)));
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[j], bcast_word256(xp + 16 + 4 * j)));
            }
            return _mm256_madd_epi16(s, one);
        };
        __m256i pi = dot(xq);
        if constexpr (Wide) pi = q16_join(pi, dot(x.qrow2(m0 + i) + b * 32));
        const __m256 p = _mm256_cvtepi32_ps(pi);
        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(q8_dx(x, m0 + i, b))), p, acc[i]);
        acc[i] = _mm256_fmadd_ps(o, _mm256_set1_ps(x.sxrow(m0 + i)[b]), acc[i]);
    }
}

// R input rows against one group of 16 weight rows (res: R x 16). Either loop order gives each
// output the same operations in the same order (its half's block after block).
template <class F, int R, bool Wide>
void x16_group(const Q8Rows& x, int64_t m0, const uint8_t* group, float* res, const uint8_t* pf) {
    constexpr bool q8 = std::is_same_v<F, FmtQ8_0>;
    constexpr int64_t BB = x16_block_bytes<F>();
    auto half_rows = [&](int64_t b, int half, __m256* acc) {
        if constexpr (q8)
            x16_half_q8_0<R, Wide>(x, m0, b, group + b * BB, half, acc);
        else
            x16_half_q4<F, R, Wide>(x, m0, b, group + b * BB, half, acc);
    };
    auto prefetch = [&](int64_t b) {  // the same block of a group X16_PREFETCH_GROUPS ahead
        if (pf)
            for (int64_t o = 0; o < BB; o += 64) prefetch_l2(pf + b * BB + o);
    };
    if constexpr (R <= (q8 ? X16_FUSED_ROWS_Q8_0 : x16_fused_rows<Wide>())) {
        __m256 acc[2][R];
        for (int h = 0; h < 2; ++h)
            for (int i = 0; i < R; ++i) acc[h][i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < x.nb; ++b) {
            prefetch(b);
            half_rows(b, 0, acc[0]);
            half_rows(b, 1, acc[1]);
        }
        for (int h = 0; h < 2; ++h)
            for (int i = 0; i < R; ++i) _mm256_storeu_ps(res + i * X16 + 8 * h, acc[h][i]);
    } else {
        for (int half = 0; half < 2; ++half) {
            __m256 acc[R];
            for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
            for (int64_t b = 0; b < x.nb; ++b) {
                if (half == 0) prefetch(b);
                half_rows(b, half, acc);
            }
            for (int i = 0; i < R; ++i) _mm256_storeu_ps(res + i * X16 + 8 * half, acc[i]);
        }
    }
}
#endif

template <class F, bool Wide>
void x16_dispatch(int64_t mb, const Q8Rows& x, int64_t m0, const uint8_t* group, float* res, const uint8_t* pf) {
    switch (mb) {
#define DART_X16_CASE(r) \
    case r:              \
        if constexpr (r <= X16_MB) return x16_group<F, r, Wide>(x, m0, group, res, pf);
        DART_X16_CASE(1) DART_X16_CASE(2) DART_X16_CASE(3) DART_X16_CASE(4) DART_X16_CASE(5) DART_X16_CASE(6)
        DART_X16_CASE(7) DART_X16_CASE(8) DART_X16_CASE(9) DART_X16_CASE(10) DART_X16_CASE(11) DART_X16_CASE(12)
        DART_X16_CASE(13) DART_X16_CASE(14) DART_X16_CASE(15) DART_X16_CASE(16)
#undef DART_X16_CASE
    }
    throw std::logic_error("linear (interleaved rows): bad row block");
}
#endif

template <class TX, class F, bool Wide>
void linear_q8x16_impl(const TX* x, int64_t x_stride, int64_t M, int64_t K, const uint8_t* w, int64_t rb, int64_t N, const TX* bias,
                       TX* out, int64_t out_stride) {
    if (N % X16) throw std::invalid_argument("linear: interleaved weights hold whole groups of 16 rows, got " + std::to_string(N));
    Q8Rows xq;
    quantize_q8(x, x_stride, M, K, xq, Wide ? 2 : 1);
#ifdef DART_V16
    const int64_t groups = N / X16;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* group = w + g * X16 * rb;
        const uint8_t* pf = g + X16_PREFETCH_GROUPS < groups ? w + (g + X16_PREFETCH_GROUPS) * X16 * rb : nullptr;
        float res[X16_MB * X16];
        for (int64_t m0 = 0, r = 0; m0 < M; m0 += row_block(M, r++, X16_MB)) {
            const int64_t mb = row_block(M, r, X16_MB);
            x16_dispatch<F, Wide>(mb, xq, m0, group, res, m0 == 0 ? pf : nullptr);
            for (int64_t i = 0; i < mb; ++i)
                for (int64_t l = 0; l < X16; ++l) {
                    float v = res[i * X16 + l];
                    if (bias) v = v + to_f32(bias[g * X16 + l]);
                    out[(m0 + i) * out_stride + g * X16 + l] = from_f32<TX>(v);
                }
        }
    }
#else
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n)
        for (int64_t m = 0; m < M; ++m) {
            float v = x16_dot_ref<F>(xq, m, w + (n / X16) * X16 * rb, static_cast<int>(n % X16));
            if (bias) v = v + to_f32(bias[n]);
            out[m * out_stride + n] = from_f32<TX>(v);
        }
#endif
}

// ------------------------------------------------------------------------------------- bf16, rows interleaved
// bf16 weights for builds without bf16 arithmetic (avx2, avx512, generic): the blocks of 16 consecutive weight
// rows interleaved element by element ("BF16X16"), so that one input element broadcast to every lane
// meets 16 weight rows in one fma pair. Per group of 16 rows and element k: 16 bf16 (32 bytes), the
// value of row r at position 2r (r < 8) or 2(r - 8) + 1, so that one 256-bit load widens to rows 0-7
// by a shift and to rows 8-15 by a mask (no shuffle). Against the layout as stored (a weight row's 16
// elements in lanes, one pass per input row, lanes reduced at the end) an input row costs 2 fmas and
// one broadcast per 16 weights instead of 2 fmas and 2 loads, and there is no reduction: with the AVX2
// build forced on the Zen 4 EPYC the embedded model's 6-row forward costs 1.2-1.3x its one-row step
// against 1.7x as stored (docs/engine.md, "bf16 without bf16 arithmetic"). The weights stream the
// same bytes.
//
// Contract (chain), per output (weight row n, input row m): acc = +0; for k = 0 .. K-1 in order:
// acc = fma(x_mk, w_nk, acc) in fp32; then + bias and one rounding to the activations' dtype. No lane
// reduction, so the generic, AVX2 and AVX-512 builds give the same bits (the avx512bf16 build too: it
// keeps vdpbf16ps for bf16 weights as stored, not for this format). Another order than the 16-lane
// contract: a model reads its bf16 weights in one layout or the other, never both.

inline int bf16x16_pos(int64_t r) { return r < 8 ? static_cast<int>(2 * r) : static_cast<int>(2 * (r - 8) + 1); }

inline float bf16x16_dot_ref(const float* xf, const uint16_t* group, int64_t lane, int64_t K) {
    const int p = bf16x16_pos(lane);
    float acc = 0.0f;
    for (int64_t k = 0; k < K; ++k) acc = std::fmaf(xf[k], to_f32(group[k * X16 + p]), acc);
    return acc;
}

#if defined(DART_V16_AVX512)
constexpr int64_t BF16X16_MB = 12;  // input rows per row block: 12 accumulators + weights + input of 32 zmm registers
#else
constexpr int64_t BF16X16_MB = 6;  // 12 accumulators + 2 weights + 1 input of 16 ymm registers
#endif
// Prefetch distance within a thread's stream of groups (its share of the weights is one contiguous
// run, read in order). Measured on the Zen 4 EPYC with the AVX2 build, the embedded target's 121
// linears (269 MB) from memory, paired rounds, against 8 KB: no prefetch +5% at one row, +40% at 3
// rows, +48% at 6; 4 KB +6%, +10%, -5%; 16 KB +3%, +1%, +2%.
constexpr int64_t BF16X16_PREFETCH = 8192;

#ifdef DART_V16
// One group of 16 weight rows (w: K x 16 bf16) against R input rows of xf (K apart): res[i * ld + l]
// = the chain of input row i and weight row l. One group at a time, although that is only 2R (AVX2)
// or R (AVX-512) fma chains: several groups at once (more chains in flight) read several streams
// 18-48 KB apart and measured slower from memory (Zen 4 EPYC, AVX2 build, named accumulators, the
// 121 linears of the embedded target with its LM head, paired rounds: one row 2 groups +5%, 3 groups
// +9%; two rows +10%, +14%; three rows, 2 groups +20%). Prefetches the line BF16X16_PREFETCH ahead
// while pf_end is past it (nullptr: none; row blocks after the first find the group in L1 or L2).
template <int R>
void bf16x16_group(const float* xf, int64_t K, const uint16_t* w, float* res, int64_t ld, const uint16_t* pf_end) {
    constexpr int64_t PF = BF16X16_PREFETCH / 2;  // elements ahead
    const int64_t pf_until = pf_end ? std::max<int64_t>(0, std::min<int64_t>(K, (pf_end - w - PF) / X16)) : 0;  // k with k*16 + PF inside
#if defined(DART_V16_AVX512)
    // named accumulators, not an array: GCC kept an array of vectors on the stack, storing every one
    // each step (the AVX2 6-row pass ran at half speed)
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
    for (int64_t k = 0; k < K; ++k) {
        const uint16_t* p = w + k * X16;
        if ((k & 1) == 0 && k < pf_until) prefetch_l2(p + PF);
        const __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#define DART_X16_ROW(i) \
    if constexpr (R > i) a##i = _mm512_fmadd_ps(_mm512_set1_ps(xf[i * K + k]), wv, a##i);
        DART_X16_ROW(0) DART_X16_ROW(1) DART_X16_ROW(2) DART_X16_ROW(3) DART_X16_ROW(4) DART_X16_ROW(5)
        DART_X16_ROW(6) DART_X16_ROW(7) DART_X16_ROW(8) DART_X16_ROW(9) DART_X16_ROW(10) DART_X16_ROW(11)
#undef DART_X16_ROW
    }
    // lane p holds row p / 2 (p even) or 8 + p / 2 (p odd): back to row order
    const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m512 acc[12] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11};
    for (int i = 0; i < R; ++i) _mm512_storeu_ps(res + i * ld, _mm512_permutexvar_ps(order, acc[i]));
#else
    __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0, l4 = l0, h4 = l0, l5 = l0, h5 = l0;
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t k = 0; k < K; ++k) {
        const uint16_t* p = w + k * X16;
        if ((k & 1) == 0 && k < pf_until) prefetch_l2(p + PF);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        const __m256 wl = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));  // rows 0-7
        const __m256 wh = _mm256_castsi256_ps(_mm256_and_si256(v, high));  // rows 8-15
#define DART_X16_ROW(i)                                         \
    if constexpr (R > i) {                                      \
        const __m256 xb = _mm256_broadcast_ss(xf + i * K + k);  \
        l##i = _mm256_fmadd_ps(xb, wl, l##i);                   \
        h##i = _mm256_fmadd_ps(xb, wh, h##i);                   \
    }
        DART_X16_ROW(0) DART_X16_ROW(1) DART_X16_ROW(2) DART_X16_ROW(3) DART_X16_ROW(4) DART_X16_ROW(5)
#undef DART_X16_ROW
    }
    const __m256 lo[6] = {l0, l1, l2, l3, l4, l5}, hi[6] = {h0, h1, h2, h3, h4, h5};
    for (int i = 0; i < R; ++i) {
        _mm256_storeu_ps(res + i * ld, lo[i]);
        _mm256_storeu_ps(res + i * ld + 8, hi[i]);
    }
#endif
}

template <int R = 1>
void bf16x16_dispatch(int64_t mb, const float* xf, int64_t K, const uint16_t* w, float* res, int64_t ld, const uint16_t* pf_end) {
    if constexpr (R < BF16X16_MB)
        if (mb > R) return bf16x16_dispatch<R + 1>(mb, xf, K, w, res, ld, pf_end);
    bf16x16_group<R>(xf, K, w, res, ld, pf_end);
}
#endif

template <class TX>
void linear_bf16x16_impl(const TX* x, int64_t x_stride, int64_t M, int64_t K, const uint8_t* wb, int64_t N, const TX* bias, TX* out,
                         int64_t out_stride) {
    if (N % X16) throw std::invalid_argument("linear: interleaved weights hold whole groups of 16 rows, got " + std::to_string(N));
    std::vector<float> xf(static_cast<size_t>(M * K));
    for (int64_t m = 0; m < M; ++m) load_row(x + m * x_stride, xf.data() + m * K, K);
    const uint16_t* w = reinterpret_cast<const uint16_t*>(wb);
    const int64_t groups = N / X16, gstride = X16 * K;
    const auto store = [&](const float* res, int64_t m0, int64_t mb, int64_t n0) {
        for (int64_t i = 0; i < mb; ++i)
            for (int64_t l = 0; l < X16; ++l) {
                float v = res[i * X16 + l];
                if (bias) v = v + to_f32(bias[n0 + l]);
                out[(m0 + i) * out_stride + n0 + l] = from_f32<TX>(v);
            }
    };
#ifdef DART_V16
    const uint16_t* end = w + N * K;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        float res[BF16X16_MB * X16];
        for (int64_t m0 = 0, r = 0; m0 < M; m0 += row_block(M, r++, BF16X16_MB)) {  // the first row block streams the group
            const int64_t mb = row_block(M, r, BF16X16_MB);
            bf16x16_dispatch(mb, xf.data() + m0 * K, K, w + g * gstride, res, X16, m0 == 0 ? end : nullptr);
            store(res, m0, mb, g * X16);
        }
    }
#else
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        float res[X16];
        for (int64_t m = 0; m < M; ++m) {
            for (int64_t l = 0; l < X16; ++l) res[l] = bf16x16_dot_ref(xf.data() + m * K, w + g * gstride, l, K);
            store(res, m, 1, g * X16);
        }
    }
#endif
}

#if defined(DART_X86) && defined(__AVX2__)
inline void transpose8(__m256 r[8]) {  // r[j] lane i -> r[i] lane j
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]), t2 = _mm256_unpacklo_ps(r[2], r[3]),
                 t3 = _mm256_unpackhi_ps(r[2], r[3]), t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]),
                 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE), s2 = _mm256_shuffle_ps(t1, t3, 0x44),
                 s3 = _mm256_shuffle_ps(t1, t3, 0xEE), s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE),
                 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20), r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20), r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31), r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31), r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Whole groups to fp32 (a prefill's GEMM operand), 8 elements of 16 rows at a time: widened as the
// kernel widens them, then two 8 x 8 transposes. The same values as the scalar loop below, faster
// (the embedded model's 120 layer linears, each result freed before the next as in a prefill, forced
// AVX2 on the Zen 4 EPYC: 28.8 -> 18.4 ms; torch's .to(float32) of the bf16 tensors: 9-11 ms).
inline void dequantize_bf16x16_groups_f32(const uint16_t* w, int64_t K, int64_t groups, float* out, int64_t out_stride) {
#pragma omp parallel for schedule(static) if (groups * X16 * K > 65536)
    for (int64_t g = 0; g < groups; ++g) {
        const uint16_t* src = w + g * X16 * K;
        float* dst = out + g * X16 * out_stride;
        const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
        for (int64_t k = 0; k < K; k += 8) {
            __m256 lo[8], hi[8];
            for (int j = 0; j < 8; ++j) {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (k + j) * X16));
                lo[j] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));  // rows 0-7 at element k + j
                hi[j] = _mm256_castsi256_ps(_mm256_and_si256(v, high));  // rows 8-15
            }
            transpose8(lo);
            transpose8(hi);
            for (int r = 0; r < 8; ++r) {
                _mm256_storeu_ps(dst + r * out_stride + k, lo[r]);
                _mm256_storeu_ps(dst + (8 + r) * out_stride + k, hi[r]);
            }
        }
    }
}
#endif

// rows (n,) of a BF16X16 weight (nullptr: rows 0..n-1) -> out (n, K), exactly (rounded to TO if fp16).
template <class TO> void dequantize_bf16x16_impl(const uint16_t* w, int64_t K, const int64_t* rows, int64_t n, TO* out, int64_t out_stride) {
#if defined(DART_X86) && defined(__AVX2__)
    if constexpr (std::is_same_v<TO, float>)
        if (!rows && K % 8 == 0 && n % X16 == 0) return dequantize_bf16x16_groups_f32(w, K, n / X16, out, out_stride);
#endif
#pragma omp parallel for schedule(static) if (n * K > 65536)
    for (int64_t i = 0; i < n; ++i) {
        const int64_t r = rows ? rows[i] : i;
        const uint16_t* src = w + (r / X16) * X16 * K + bf16x16_pos(r % X16);
        TO* dst = out + i * out_stride;
        for (int64_t k = 0; k < K; ++k) dst[k] = from_f32<TO>(to_f32(src[k * X16]));
    }
}

#ifdef __AVX512BF16__
// bf16 on CPUs with AVX512-BF16: vdpbf16ps multiplies bf16 pairs and adds them into fp32 lanes with
// the ISA's fixed order and rounding (lane l of a 32-element chunk takes elements 2l and 2l+1), twice
// the multiply rate of converting to fp32 first. Still one fixed sequence per output element: the
// contract above with "pairs of bf16" in place of "fp32 fma" (so results differ from CPUs without
// the instruction, never between row counts on one CPU).
constexpr int64_t PAIR_LANES = 32;
constexpr int64_t BF16_MB = 5;  // input rows per block: 5 x NB accumulators + NB weights + 1 input of 32 registers
// 6 to 9 rows (a tree verify of 5-8 drafted nodes) run as ONE row block against blocks of 3 weight rows
// (up to 9 x 3 accumulators + 3 weights of 32 registers; the input is a memory operand), so the weights
// pass through the core once: as two row blocks (5 + 4) the second pass was ~3 ms of a 9-row forward.
constexpr int64_t BF16_WIDE_MIN = 6, BF16_WIDE_MAX = 9, BF16_WIDE_NB = 3;

// Size of the r-th of the ceil(M / BF16_MB) row blocks, as even as possible (9 rows: 5 + 4, not 5 + 4 + 0;
// 6 rows: 3 + 3, not 5 + 1), so no block wastes a weight load on one row.
inline int64_t row_block(int64_t M, int64_t r) {
    const int64_t n = (M + BF16_MB - 1) / BF16_MB, base = M / n;
    return base + (r < M % n ? 1 : 0);
}

// from_f32<uint16_t> on four lanes: round to nearest even, any NaN -> 0x7fc0; stores 4 bf16.
inline void store4_bf16(uint16_t* dst, __m128 v) {
    const __m128i bits = _mm_castps_si128(v);
    const __m128i lsb = _mm_and_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(1));
    const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(bits, _mm_set1_epi32(0x7fff)), lsb), 16);
    const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(bits, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
    const __m128i h = _mm_blendv_epi8(rounded, _mm_set1_epi32(0x7fc0), nan);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi32(h, h));
}

// The nbw weight rows from row n0 of w (N, K): in place, or for the last partial block (nb < nbw
// rows left) a zero-padded copy in `pad`, whose extra rows' results the caller drops.
inline const uint16_t* weight_block(const uint16_t* w, int64_t n0, int64_t nb, int64_t nbw, int64_t K, std::vector<uint16_t>& pad) {
    if (nb == nbw) return w + n0 * K;
    pad.assign(static_cast<size_t>(nbw * K), 0);
    std::memcpy(pad.data(), w + n0 * K, nb * K * sizeof(uint16_t));
    return pad.data();
}

// MBc input rows x NBc weight rows (NBc 3 or 4); res [MBc][NB] (lanes >= NBc of a row are zero).
template <int MBc, int NBc = NB>
void linear_bf16_block(const uint16_t* x, int64_t K, const uint16_t* w, float* res, const uint16_t* pf) {
    static_assert(NBc == 3 || NBc == 4, "reduce4_zmm reduces up to four dots");
    __m512 acc[MBc][NBc];
    for (int i = 0; i < MBc; ++i)
        for (int j = 0; j < NBc; ++j) acc[i][j] = _mm512_setzero_ps();
    const int64_t full = K / PAIR_LANES * PAIR_LANES;
    for (int64_t k = 0; k < full; k += PAIR_LANES) {
        __m512bh wv[NBc];
#pragma GCC unroll 8
        for (int j = 0; j < NBc; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
        if (pf) prefetch_chunk(pf, K, k, NBc);
#pragma GCC unroll 9
        for (int i = 0; i < MBc; ++i) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * K + k);
#pragma GCC unroll 8
            for (int j = 0; j < NBc; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    if (full < K) {  // zero-filled tail lanes add +0 products: acc starts at +0 and never becomes -0
        const __mmask32 live = static_cast<__mmask32>((1ull << (K - full)) - 1);
        __m512bh wv[NBc];
        for (int j = 0; j < NBc; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(live, w + j * K + full);
        for (int i = 0; i < MBc; ++i) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(live, x + i * K + full);
            for (int j = 0; j < NBc; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    // lane u of reduce4_zmm is reduce_zmm of its u-th vector whatever the others are: a zero fourth
    // vector leaves the three dots' bits as they are
    for (int i = 0; i < MBc; ++i)
        _mm_storeu_ps(res + i * NB, reduce4_zmm(acc[i][0], acc[i][1], acc[i][2], NBc == 4 ? acc[i][NBc - 1] : _mm512_setzero_ps()));
}

// 6 to 9 rows: one row block against blocks of BF16_WIDE_NB weight rows (see BF16_WIDE_MIN).
void linear_bf16_wide(const uint16_t* xc, int64_t M, int64_t K, const uint16_t* w, int64_t N, const uint16_t* bias,
                      uint16_t* out, int64_t out_stride) {
    constexpr int64_t NBW = BF16_WIDE_NB;
    const int64_t blocks = (N + NBW - 1) / NBW;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n0 = b * NBW, nb = std::min(NBW, N - n0);
        std::vector<uint16_t> wpad;
        const uint16_t* wb = weight_block(w, n0, nb, NBW, K, wpad);
        const uint16_t* pf = weight_prefetch(w, b, N, K, NBW);
        float res[BF16_WIDE_MAX * NB];
        switch (M) {
            case 6: linear_bf16_block<6, NBW>(xc, K, wb, res, pf); break;
            case 7: linear_bf16_block<7, NBW>(xc, K, wb, res, pf); break;
            case 8: linear_bf16_block<8, NBW>(xc, K, wb, res, pf); break;
            default: linear_bf16_block<9, NBW>(xc, K, wb, res, pf); break;
        }
        for (int64_t i = 0; i < M; ++i)  // the same fp32 bias add and rounding as the four-wide store
            for (int64_t j = 0; j < nb; ++j) {
                float v = res[i * NB + j];
                if (bias) v = v + to_f32(bias[n0 + j]);
                out[i * out_stride + n0 + j] = from_f32<uint16_t>(v);
            }
    }
}

void linear_bf16_dp(const uint16_t* x, int64_t x_stride, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                    const uint16_t* bias, uint16_t* out, int64_t out_stride) {
    std::vector<uint16_t> xc(static_cast<size_t>(M * K));
    for (int64_t m = 0; m < M; ++m) std::memcpy(xc.data() + m * K, x + m * x_stride, K * sizeof(uint16_t));
    if (M >= BF16_WIDE_MIN && M <= BF16_WIDE_MAX) return linear_bf16_wide(xc.data(), M, K, w, N, bias, out, out_stride);
    const int64_t blocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n0 = b * NB, nb = std::min(NB, N - n0);
        std::vector<uint16_t> wpad;
        const uint16_t* wb = weight_block(w, n0, nb, NB, K, wpad);
        const uint16_t* pf = weight_prefetch(w, b, N, K);  // by the first row block only
        float res[BF16_MB * NB];
        __m128 bias4 = _mm_setzero_ps();
        if (bias && nb == NB) {
            float bf[NB];
            for (int64_t j = 0; j < NB; ++j) bf[j] = to_f32(bias[n0 + j]);
            bias4 = _mm_loadu_ps(bf);
        }
        for (int64_t m0 = 0, r = 0; m0 < M; m0 += row_block(M, r++)) {
            const int64_t mb = row_block(M, r);
            const uint16_t* xb = xc.data() + m0 * K;
            switch (mb) {
                case 1: linear_bf16_block<1>(xb, K, wb, res, m0 == 0 ? pf : nullptr); break;
                case 2: linear_bf16_block<2>(xb, K, wb, res, m0 == 0 ? pf : nullptr); break;
                case 3: linear_bf16_block<3>(xb, K, wb, res, m0 == 0 ? pf : nullptr); break;
                case 4: linear_bf16_block<4>(xb, K, wb, res, m0 == 0 ? pf : nullptr); break;
                default: linear_bf16_block<5>(xb, K, wb, res, m0 == 0 ? pf : nullptr); break;
            }
            if (nb == NB) {  // four outputs a row at once: the same fp32 add and the same rounding
                for (int64_t i = 0; i < mb; ++i) {
                    __m128 v = _mm_loadu_ps(res + i * NB);
                    if (bias) v = _mm_add_ps(v, bias4);
                    store4_bf16(out + (m0 + i) * out_stride + n0, v);
                }
                continue;
            }
            for (int64_t i = 0; i < mb; ++i)
                for (int64_t j = 0; j < nb; ++j) {
                    float v = res[i * NB + j];
                    if (bias) v = v + to_f32(bias[n0 + j]);
                    out[(m0 + i) * out_stride + n0 + j] = from_f32<uint16_t>(v);
                }
        }
    }
}
#endif

// ------------------------------------------------------------------------------------- residual add + RMSNorm
// x_out = x + delta (rounded to T; delta may be null: x_out = x), normed = w * round(x_out * r) with
// r = 1 / sqrt(mean(x_out^2) + eps), all in fp32, each product rounded to T as the eager path does.
// x, delta, x_out, normed: (M, H) contiguous; w (H,).

template <class T>
void add_rmsnorm_impl(const T* x, const T* delta, const T* w, int64_t M, int64_t H, float eps, T* x_out, T* normed) {
    std::vector<float> row(static_cast<size_t>(H));
    for (int64_t m = 0; m < M; ++m) {
        const T* xr = x + m * H;
        T* xo = x_out + m * H;
        for (int64_t i = 0; i < H; ++i) {
            const float v = delta ? to_f32(from_f32<T>(to_f32(xr[i]) + to_f32(delta[m * H + i]))) : to_f32(xr[i]);
            row[i] = v;
            xo[i] = from_f32<T>(v);
        }
        const float mean = dot(row.data(), row.data(), H) / static_cast<float>(H);
        const float r = 1.0f / std::sqrt(mean + eps);
        T* out = normed + m * H;
        for (int64_t i = 0; i < H; ++i) out[i] = from_f32<T>(to_f32(w[i]) * to_f32(from_f32<T>(row[i] * r)));
    }
}

// ------------------------------------------------------------------------------------- gated activation
// out[m, i] = silu(gu[m, i]) * gu[m, I + i], each product rounded to T as the eager path does
// (silu rounded, then the product rounded). gu (M, 2I) rows gu_stride apart; out (M, I) contiguous.

#ifdef DART_V16
// silu(g) * u on 8 fp32 lanes: silu_mul_impl's scalar steps one for one (the same constants, the same
// unfused multiplies and adds, IEEE division, the current rounding mode for nearbyint, a blend for
// its branch), so each element gets the scalar loop's bits. The scalar loop ran serially (one
// thread) before every down projection: ~0.5 ms of a 4-row forward of the embedded model with AVX2.
inline __m256 exp_nonpositive8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // std::max(x, -87): x when x is NaN, as maxps' second operand
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(1.428606765330187045e-06f)));
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    for (const float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f}) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline __m256 silu8(__m256 x) {  // x * sigmoid(x), the scalar loop's steps
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 t = exp_nonpositive8(_mm256_or_ps(x, _mm256_set1_ps(-0.0f)));  // e^{-|x|}
    const __m256 d = _mm256_add_ps(one, t);
    const __m256 sig = _mm256_blendv_ps(_mm256_div_ps(t, d), _mm256_div_ps(one, d), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
    return _mm256_mul_ps(x, sig);
}
inline int64_t silu_mul_x8(const float* g, const float* u, int64_t I, float* out) {  // elements done
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
    return i;
}
// bf16: the activation rounded to bf16 before the product, the product rounded again, as the scalar
// loop does. bf16 went through the scalar loop before, on one thread (6 x 1536 elements a layer stay
// under its threading threshold): the embedded model's 6-row bf16 step after 200 tokens took 21.5 ms
// with it and 18.2 with this (AMD EPYC, AVX2).
inline int64_t silu_mul_x8(const uint16_t* g, const uint16_t* u, int64_t I, uint16_t* out) {
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) store8_bf16_rne(out + i, _mm256_mul_ps(round_bf16_8(silu8(bf16x8(g + i))), bf16x8(u + i)));
    return i;
}
#endif

template <class T> void silu_mul_impl(const T* gu, int64_t gu_stride, int64_t M, int64_t I, T* out) {
#pragma omp parallel for schedule(static) if (M * I > 32768)
    for (int64_t m = 0; m < M; ++m) {
        const T* g = gu + m * gu_stride;
        const T* u = g + I;
        int64_t i0 = 0;
#ifdef DART_V16
        if constexpr (std::is_same_v<T, float> || std::is_same_v<T, uint16_t>) i0 = silu_mul_x8(g, u, I, out + m * I);
#endif
        for (int64_t i = i0; i < I; ++i) {
            const float x = to_f32(g[i]);
            const float t = exp_nonpositive(-std::fabs(x));  // e^{-|x|}: sigmoid without overflow
            const float sig = x >= 0.0f ? 1.0f / (1.0f + t) : t / (1.0f + t);
            const float act = to_f32(from_f32<T>(x * sig));
            out[m * I + i] = from_f32<T>(act * to_f32(u[i]));
        }
    }
}

// ------------------------------------------------------------------------------------- tree attention
// One layer, new rows i = 0..T-1 after P committed cache entries.
//   q/k/v: row i at q + i*q_stride (nh*hd, heads contiguous), k + i*k_stride (nkv*hd), v likewise;
//          q and k are pre-RoPE.  cos/sin: fp32 tables (positions, hd/2); row i uses position pos[i].
//   k_cache/v_cache: (nkv, cap, hd) contiguous for this layer, of element type C (the activations' T, or
//          fp16 beside fp32 activations); row i is written at slot P+i, its key and value rounded to C.
//   parents[i]: the parent row of row i (-1 for the root).  Row i attends, in this order, to slots
//          0..P-1, its ancestors' slots from the root down, and its own slot: exactly the keys (and
//          the order) a one-token step would see once the ancestors are committed.
//   out: (T, nh*hd) rows out_stride apart.

// Attention's two inner loops, for the R query heads of one KV group (R = heads per group): each key
// and value row is loaded and converted once for up to four heads, and head r's arithmetic is exactly
// what it would be alone (scores: one key's lane tree; values: the keys in order per lane). Generic
// lane loops, and for head dims that are a multiple of 16 the same arithmetic in V16 registers.

#ifdef DART_V16
// Keys per block of key_scores_v and 16-lane groups per pass of weighted_values_v: as many as the
// registers hold (AVX2 has 16 ymm and a V16 takes two).
#if defined(DART_V16_AVX512)
constexpr int ATT_KEYS = 4, ATT_GROUPS = 4;
#else
constexpr int ATT_KEYS = 1, ATT_GROUPS = 2;
#endif
// Committed keys ahead that the two loops prefetch: the cache streams from memory at every step (the
// weights between two layers' attention evict it). On the AVX2 EPYC 8, 16 and 32 keys for the scores
// and 8 to 64 for the values measured the same (the passes' benchmark after 300 and 700 tokens).
constexpr int64_t ATT_PREFETCH = 8;

// The cache lines of n bytes at p into L1 (a key or value row, or a row's lane group)
inline void prefetch_bytes(const void* p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + o, _MM_HINT_T0);
}

template <int R, class T>
void key_scores_v(const float* q, const T* kc, int64_t P, const std::vector<int64_t>& tl, int64_t L, int64_t hd,
                  float scale, float* out, int64_t out_stride) {
    const int64_t C = hd / LANES;
    int64_t j = 0;
    if constexpr (ATT_KEYS == 4) {
        for (; j + 4 <= L; j += 4) {  // four keys, their four lane trees reduced side by side
            if (j + 4 + ATT_PREFETCH <= P) prefetch_bytes(kc + (j + ATT_PREFETCH) * hd, 4 * hd * static_cast<int64_t>(sizeof(T)));
            const T* kr[4];
            for (int u = 0; u < 4; ++u) kr[u] = kc + (j + u < P ? j + u : tl[j + u - P]) * hd;
            V16 acc[R][4];
            for (int r = 0; r < R; ++r)
                for (int u = 0; u < 4; ++u) acc[r][u] = v_zero();
            for (int64_t c = 0; c < C; ++c) {
                V16 kv[4];
                for (int u = 0; u < 4; ++u) kv[u] = v_load(kr[u] + c * LANES);
                for (int r = 0; r < R; ++r) {
                    const V16 qv = v_load(q + r * hd + c * LANES);
                    for (int u = 0; u < 4; ++u) acc[r][u] = v_fma(qv, kv[u], acc[r][u]);
                }
            }
            for (int r = 0; r < R; ++r)
                _mm_storeu_ps(out + r * out_stride + j, _mm_mul_ps(v_reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), _mm_set1_ps(scale)));
        }
    }
    for (; j < L; ++j) {
        if (j + ATT_PREFETCH < P) prefetch_bytes(kc + (j + ATT_PREFETCH) * hd, hd * static_cast<int64_t>(sizeof(T)));
        const T* kr = kc + (j < P ? j : tl[j - P]) * hd;
        V16 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = v_zero();
        for (int64_t c = 0; c < C; ++c) {
            const V16 kv = v_load(kr + c * LANES);
            for (int r = 0; r < R; ++r) acc[r] = v_fma(v_load(q + r * hd + c * LANES), kv, acc[r]);
        }
        for (int r = 0; r < R; ++r) out[r * out_stride + j] = v_reduce(acc[r]) * scale;
    }
}

// G lane groups of R heads' weighted values in one pass over the keys. G is a template parameter so
// that the R x G accumulators stay in registers: with a run-time group count GCC kept them on the
// stack, a store and a load on every key's dependency chain (AVX2, two groups a pass: 700 keys'
// values of an fp16 cache 30 -> 20 us a layer; docs/engine.md, "An fp16 KV cache").
template <int R, int G, class T>
void weighted_values_g(const float* p, int64_t p_stride, const T* vc, int64_t P, const std::vector<int64_t>& tl, int64_t L,
                       int64_t hd, int64_t c0, float* out) {
    V16 acc[R][G];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < G; ++c) acc[r][c] = v_zero();
    for (int64_t j = 0; j < L; ++j) {
        if (j + ATT_PREFETCH < P) prefetch_bytes(vc + (j + ATT_PREFETCH) * hd + c0 * LANES, G * LANES * static_cast<int64_t>(sizeof(T)));
        const T* vr = vc + (j < P ? j : tl[j - P]) * hd + c0 * LANES;
        V16 pj[R];
        for (int r = 0; r < R; ++r) pj[r] = v_set1(p[r * p_stride + j]);
        for (int c = 0; c < G; ++c) {
            const V16 vv = v_load(vr + c * LANES);
            for (int r = 0; r < R; ++r) acc[r][c] = v_fma(pj[r], vv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < G; ++c) v_store(out + r * hd + (c0 + c) * LANES, acc[r][c]);
}

// Lane groups [g0, g1): ATT_GROUPS at a time, then pairs, then one by one (every lane's sum is over
// the keys in order however the groups are batched).
template <int R, class T>
void weighted_values_v(const float* p, int64_t p_stride, const T* vc, int64_t P, const std::vector<int64_t>& tl, int64_t L,
                       int64_t hd, int64_t g0, int64_t g1, float* out) {
    int64_t c = g0;
    for (; c + ATT_GROUPS <= g1; c += ATT_GROUPS) weighted_values_g<R, ATT_GROUPS>(p, p_stride, vc, P, tl, L, hd, c, out);
    if constexpr (ATT_GROUPS > 2)
        for (; c + 2 <= g1; c += 2) weighted_values_g<R, 2>(p, p_stride, vc, P, tl, L, hd, c, out);
    for (; c < g1; ++c) weighted_values_g<R, 1>(p, p_stride, vc, P, tl, L, hd, c, out);
}
#endif

template <class T>
void key_scores(const float* q /* [R][hd] */, int64_t R, const T* kc, int64_t P, const std::vector<int64_t>& tl, int64_t L,
                int64_t hd, float scale, float* kf, float* out /* [R][out_stride] */, int64_t out_stride) {
#ifdef DART_V16
    if (hd % LANES == 0) {
        switch (R) {
            case 1: return key_scores_v<1>(q, kc, P, tl, L, hd, scale, out, out_stride);
            case 2: return key_scores_v<2>(q, kc, P, tl, L, hd, scale, out, out_stride);
            case 3: return key_scores_v<3>(q, kc, P, tl, L, hd, scale, out, out_stride);
            case 4: return key_scores_v<4>(q, kc, P, tl, L, hd, scale, out, out_stride);
            default:  // more heads per group: four at a time (each head's arithmetic is its own)
                for (int64_t r = 0; r < R; r += 4)
                    key_scores(q + r * hd, std::min<int64_t>(4, R - r), kc, P, tl, L, hd, scale, kf, out + r * out_stride, out_stride);
                return;
        }
    }
#endif
    for (int64_t j = 0; j < L; ++j) {
        load_row(kc + (j < P ? j : tl[j - P]) * hd, kf, hd);
        for (int64_t r = 0; r < R; ++r) out[r * out_stride + j] = dot(q + r * hd, kf, hd) * scale;
    }
}

// Lanes [LANES g0, LANES g1) of out (clipped to hd): each lane's sum is over the keys in order whatever
// the range, so a head's output can be computed a lane group at a time (tree_attention_impl does).
template <class T>
void weighted_values(const float* p /* [R][p_stride] */, int64_t p_stride, int64_t R, const T* vc, int64_t P,
                     const std::vector<int64_t>& tl, int64_t L, int64_t hd, float* vf, float* out /* [R][hd] */, int64_t g0,
                     int64_t g1) {
#ifdef DART_V16
    if (hd % LANES == 0) {
        switch (R) {
            case 1: return weighted_values_v<1>(p, p_stride, vc, P, tl, L, hd, g0, g1, out);
            case 2: return weighted_values_v<2>(p, p_stride, vc, P, tl, L, hd, g0, g1, out);
            case 3: return weighted_values_v<3>(p, p_stride, vc, P, tl, L, hd, g0, g1, out);
            case 4: return weighted_values_v<4>(p, p_stride, vc, P, tl, L, hd, g0, g1, out);
            default:
                for (int64_t r = 0; r < R; r += 4)
                    weighted_values(p + r * p_stride, p_stride, std::min<int64_t>(4, R - r), vc, P, tl, L, hd, vf, out + r * hd, g0, g1);
                return;
        }
    }
#endif
    const int64_t d0 = g0 * LANES, d1 = std::min(g1 * LANES, hd);
    for (int64_t r = 0; r < R; ++r) std::fill(out + r * hd + d0, out + r * hd + d1, 0.0f);
    for (int64_t j = 0; j < L; ++j) {
        load_row(vc + (j < P ? j : tl[j - P]) * hd + d0, vf + d0, d1 - d0);
        for (int64_t r = 0; r < R; ++r)
            for (int64_t d = d0; d < d1; ++d) out[r * hd + d] = std::fma(p[r * p_stride + j], vf[d], out[r * hd + d]);
    }
}

// e^(a[j] - mx) in place for j < n, exp_nonpositive's bits (8 lanes at a time where the build has them)
inline void exp_shifted(float* a, int64_t n, float mx) {
    int64_t j = 0;
#ifdef DART_V16
    const __m256 m = _mm256_set1_ps(mx);
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(a + j, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(a + j), m)));
#endif
    for (; j < n; ++j) a[j] = exp_nonpositive(a[j] - mx);
}

// max(a[0..n)) as the scalar fold mx = std::max(mx, a[j]) from mx = a[0] computes it (a NaN a[j] is
// skipped, a NaN a[0] kept): a maximum does not depend on the order it is taken in, so 16 lanes give
// the same value. The scalar fold is one dependent vmaxss per key: it was two thirds of the softmax.
inline float max_of(const float* a, int64_t n) {
    float mx = a[0];
    int64_t j = 1;
#if defined(DART_V16_AVX512)
    if (n >= 17) {
        __m512 m = _mm512_set1_ps(a[0]);
        for (; j + 16 <= n; j += 16) m = _mm512_max_ps(_mm512_loadu_ps(a + j), m);  // second operand kept on NaN
        float lanes[16];
        _mm512_storeu_ps(lanes, m);
        for (float l : lanes) mx = std::max(mx, l);
    }
#elif defined(DART_V16_AVX2)
    if (n >= 9) {
        __m256 m = _mm256_set1_ps(a[0]);
        for (; j + 8 <= n; j += 8) m = _mm256_max_ps(_mm256_loadu_ps(a + j), m);
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (float l : lanes) mx = std::max(mx, l);
    }
#endif
    for (; j < n; ++j) mx = std::max(mx, a[j]);
    return mx;
}

// One KV group's attention for its `rep` query heads (qf [rep][hd], RoPE applied, fp32) over the
// logical key sequence: slots 0..P-1 of kc/vc, then the slots listed in tl (L = P + tl.size() keys).
// Scores, softmax and values in the fixed order of the contract; writes head r's output to
// dst + r * hd. kf, vf [hd], scores [rep][max_len], acc [rep][hd] are the caller's scratch.
template <class C, class T>
void attend_group(const float* qf, int64_t rep, const C* kc, const C* vc, int64_t P, const std::vector<int64_t>& tl, int64_t L,
                  int64_t hd, float scale, float* kf, float* vf, float* scores, int64_t max_len, float* acc, T* dst) {
    key_scores(qf, rep, kc, P, tl, L, hd, scale, kf, scores, max_len);
    for (int64_t r = 0; r < rep; ++r) {
        float* sr = scores + r * max_len;
        exp_shifted(sr, L, max_of(sr, L));
    }
    weighted_values(scores, max_len, rep, vc, P, tl, L, hd, vf, acc, 0, (hd + LANES - 1) / LANES);
    for (int64_t r = 0; r < rep; ++r) {
        const float denom = sum(scores + r * max_len, L);
        for (int64_t d = 0; d < hd; ++d) dst[r * hd + d] = from_f32<T>(acc[r * hd + d] / denom);
    }
}

// A new row's key, RoPE in fp32 rounded to the cache dtype, and its value (rounded to it), written at
// `slot` of every KV group of one sequence's cache (nkv, cap, hd). c / s: the row's cos / sin (hd/2).
template <class T, class C>
inline void store_key_value(const T* k, const T* v, const float* c, const float* s, C* k_cache, C* v_cache, int64_t cap,
                            int64_t slot, int64_t nkv, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t g = 0; g < nkv; ++g) {
        const T* src = k + g * hd;
        C* dst = k_cache + (g * cap + slot) * hd;
        for (int64_t d = 0; d < half; ++d) {
            const float x1 = to_f32(src[d]), x2 = to_f32(src[d + half]);
            dst[d] = from_f32<C>(x1 * c[d] - x2 * s[d]);
            dst[d + half] = from_f32<C>(x2 * c[d] + x1 * s[d]);
        }
        if constexpr (std::is_same_v<T, C>) {
            std::memcpy(v_cache + (g * cap + slot) * hd, v + g * hd, hd * sizeof(T));
        } else {
            for (int64_t d = 0; d < hd; ++d) v_cache[(g * cap + slot) * hd + d] = from_f32<C>(to_f32(v[g * hd + d]));
        }
    }
}

// The `rep` query heads of one KV group (q: the group's first head), RoPE in fp32 and kept in fp32.
template <class T>
inline void rope_queries(const T* q, const float* c, const float* s, int64_t rep, int64_t hd, float* qf) {
    const int64_t half = hd / 2;
    for (int64_t r = 0; r < rep; ++r) {
        const T* src = q + r * hd;
        float* dst = qf + r * hd;
        for (int64_t d = 0; d < half; ++d) {
            const float x1 = to_f32(src[d]), x2 = to_f32(src[d + half]);
            dst[d] = x1 * c[d] - x2 * s[d];
            dst[d + half] = x2 * c[d] + x1 * s[d];
        }
    }
}

constexpr int64_t ATT_CHUNK = 64;  // committed keys per scores work item: its keys stay in L1 across the tree's rows
// Committed keys from which a layer's attention runs as three passes (below: one). Measured on the
// AVX2 EPYC, 30 layers of the embedded model's attention, fp32 cache: the passes cost ~4 us a layer
// more below ~200 keys (their barriers), and save 1.6 ms of a 4.4 ms one-row step's attention at 700.
constexpr int64_t ATT_PASSES_FROM = 256;

// A tree's rows over a cache of P committed keys. Short caches: one work item per (row, KV group),
// attend_group. From ATT_PASSES_FROM keys on, three passes over the layer's cache, each split across
// the threads so that every cached key and value is read from memory once for all rows and query
// heads: (1) scores, a work item per KV group and chunk of the committed keys for every row (plus an
// item per group and row for its ancestors); (2) per row and head, the maximum, the exponentials and
// their sum; (3) the weighted values, a work item per KV group and 16-lane group of the head dim for
// every row. Every output element is the contract's one sequence either way (a score is one key's
// lane tree wherever its chunk starts; a lane sums the keys in order whichever lanes share its item),
// so both give attend_group's bits. One item per (row, KV group) alone, a one-token step of the
// embedded model (3 KV groups, 2 threads) either left a thread idle or (one item per query head) read
// each group's cache once per head: 30 layers' attention after 700 cached tokens took 4.4 ms.
template <class T, class C>
void tree_attention_impl(const T* q, int64_t q_stride, const T* k, int64_t k_stride, const T* v, int64_t v_stride,
                         const float* cos, const float* sin, const int64_t* pos, C* k_cache, C* v_cache, int64_t cap,
                         int64_t P, int64_t T_, const int64_t* parents, int64_t nh, int64_t nkv, int64_t hd, float scale,
                         T* out, int64_t out_stride) {
    const int64_t half = hd / 2, rep = nh / nkv, lane_groups = (hd + LANES - 1) / LANES;
    for (int64_t i = 0; i < T_; ++i)  // the new rows' keys and values at slots P+i
        store_key_value(k + i * k_stride, v + i * v_stride, cos + pos[i] * half, sin + pos[i] * half, k_cache, v_cache, cap,
                        P + i, nkv, hd);
    // Each row's ancestor slots (root first), from the parent links.
    std::vector<std::vector<int64_t>> tail(T_);
    for (int64_t i = 0; i < T_; ++i) {
        if (parents[i] >= i) throw std::invalid_argument("tree_attention: parents[i] must be < i");
        for (int64_t a = i; a >= 0; a = parents[a]) tail[i].push_back(P + a);
        std::reverse(tail[i].begin(), tail[i].end());
    }
    int64_t max_len = 0;
    for (auto& t : tail) max_len = std::max<int64_t>(max_len, P + static_cast<int64_t>(t.size()));
    if (P < ATT_PASSES_FROM) {
#pragma omp parallel
        {
            std::vector<float> qf(static_cast<size_t>(rep * hd)), kf(hd), vf(hd), acc(static_cast<size_t>(rep * hd));
            std::vector<float> scores(static_cast<size_t>(rep * max_len));
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < T_ * nkv; ++it) {
                const int64_t i = it / nkv, g = it % nkv;
                rope_queries(q + i * q_stride + g * rep * hd, cos + pos[i] * half, sin + pos[i] * half, rep, hd, qf.data());
                attend_group(qf.data(), rep, k_cache + g * cap * hd, v_cache + g * cap * hd, P, tail[i],
                             P + static_cast<int64_t>(tail[i].size()), hd, scale, kf.data(), vf.data(), scores.data(), max_len,
                             acc.data(), out + i * out_stride + g * rep * hd);
            }
        }
        return;
    }
    // scores: (T, nh, max_len), then the softmax numerators. Not zero-filled: every element read is
    // written first (zeroing them was ~3% of a 6-row call).
    const std::unique_ptr<float[]> scores(new float[T_ * nh * max_len]), denom(new float[T_ * nh]);
    const std::vector<int64_t> none;
    const int64_t chunks = (P + ATT_CHUNK - 1) / ATT_CHUNK, prefix_items = nkv * chunks;
    // value items of a 64-byte line of each value row (one lane group of an fp32 cache, two of a 16-bit
    // one): two threads never fetch the same line (Zen 2's L3 is filled by L2 evictions, so the second
    // thread would read it from memory again)
    const int64_t item_groups = std::max<int64_t>(1, 64 / (LANES * static_cast<int64_t>(sizeof(C))));
    const int64_t value_items = (lane_groups + item_groups - 1) / item_groups;
#pragma omp parallel
    {
        std::vector<float> kf(hd), vf(hd), acc(static_cast<size_t>(rep * hd));
        // Every row's queries of one KV group after RoPE, (T, rep, hd): each thread computes those of the
        // group its item needs when the group changes (cheaper than a barrier and a shared table).
        std::vector<float> qf(static_cast<size_t>(T_ * rep * hd));
        int64_t roped = -1;
        auto queries = [&](int64_t i, int64_t g) {
            if (g != roped) {
                for (int64_t r = 0; r < T_; ++r)
                    rope_queries(q + r * q_stride + g * rep * hd, cos + pos[r] * half, sin + pos[r] * half, rep, hd, qf.data() + r * rep * hd);
                roped = g;
            }
            return qf.data() + i * rep * hd;
        };
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < prefix_items + T_ * nkv; ++it) {
            if (it < prefix_items) {  // committed keys j0..j0+n-1 of group g, every row
                const int64_t g = it / chunks, j0 = it % chunks * ATT_CHUNK, n = std::min(ATT_CHUNK, P - j0);
                for (int64_t i = 0; i < T_; ++i)
                    key_scores(queries(i, g), rep, k_cache + (g * cap + j0) * hd, n, none, n, hd, scale,
                               kf.data(), scores.get() + (i * nh + g * rep) * max_len + j0, max_len);
            } else {  // row i's ancestors and itself, group g (rows of one group in a row: queries() ropes once)
                const int64_t g = (it - prefix_items) / T_, i = (it - prefix_items) % T_;
                key_scores(queries(i, g), rep, k_cache + g * cap * hd, 0, tail[i],
                           static_cast<int64_t>(tail[i].size()), hd, scale, kf.data(),
                           scores.get() + (i * nh + g * rep) * max_len + P, max_len);
            }
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < T_ * nh; ++it) {
            const int64_t L = P + static_cast<int64_t>(tail[it / nh].size());
            float* sr = scores.get() + it * max_len;
            exp_shifted(sr, L, max_of(sr, L));
            denom[it] = sum(sr, L);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nkv * value_items; ++it) {
            const int64_t g = it / value_items, c = it % value_items * item_groups, c1 = std::min(c + item_groups, lane_groups);
            const int64_t d0 = c * LANES, d1 = std::min(c1 * LANES, hd);
            for (int64_t i = 0; i < T_; ++i) {
                const int64_t h = i * nh + g * rep, L = P + static_cast<int64_t>(tail[i].size());
                weighted_values(scores.get() + h * max_len, max_len, rep, v_cache + g * cap * hd, P, tail[i], L, hd, vf.data(),
                                acc.data(), c, c1);
                for (int64_t r = 0; r < rep; ++r)
                    for (int64_t d = d0; d < d1; ++d)
                        out[i * out_stride + (g * rep + r) * hd + d] = from_f32<T>(acc[r * hd + d] / denom[h + r]);
            }
        }
    }
}

// ------------------------------------------------------------------------------------- rows of separate sequences
// B independent sequences, one new row each (continuous-batching generation, Transformer.decode_rows):
// row b's committed length P_b = committed[b] is also its position; its cache is the slab at
// k_cache + b * seq_stride, (nkv, cap, hd). Row b is exactly a one-token tree_attention call on its own
// slab (attend_group over the prefix and the one-slot tail {P_b}: its bits), so a sequence
// decoded beside others gets the bits plain decoding gives it alone, and no padding is computed.
template <class T, class C>
void rows_attention_impl(const T* q, int64_t q_stride, const T* k, int64_t k_stride, const T* v, int64_t v_stride,
                         const float* cos, const float* sin, const int64_t* committed, C* k_cache, C* v_cache,
                         int64_t seq_stride, int64_t cap, int64_t B, int64_t nh, int64_t nkv, int64_t hd, float scale, T* out,
                         int64_t out_stride) {
    const int64_t half = hd / 2, rep = nh / nkv;
    std::vector<std::vector<int64_t>> tail(B);
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t P = committed[b];
        store_key_value(k + b * k_stride, v + b * v_stride, cos + P * half, sin + P * half, k_cache + b * seq_stride,
                        v_cache + b * seq_stride, cap, P, nkv, hd);
        tail[b] = {P};
        max_len = std::max(max_len, P + 1);
    }
#pragma omp parallel
    {
        std::vector<float> qf(static_cast<size_t>(rep * hd)), kf(hd), vf(hd), acc(static_cast<size_t>(rep * hd));
        std::vector<float> scores(static_cast<size_t>(rep * max_len));
#pragma omp for schedule(dynamic, 4)
        for (int64_t it = 0; it < B * nkv; ++it) {
            const int64_t b = it / nkv, g = it % nkv, P = committed[b];
            rope_queries(q + b * q_stride + g * rep * hd, cos + P * half, sin + P * half, rep, hd, qf.data());
            const C* kc = k_cache + b * seq_stride + g * cap * hd;
            const C* vc = v_cache + b * seq_stride + g * cap * hd;
            attend_group(qf.data(), rep, kc, vc, P, tail[b], P + 1, hd, scale, kf.data(), vf.data(), scores.data(), max_len,
                         acc.data(), out + b * out_stride + g * rep * hd);
        }
    }
}

// ------------------------------------------------------------------------------------- bindings
// Tensors cross as raw addresses (the Python side checks dtypes, shapes, contiguity and devices):
// the module needs no torch headers and builds in seconds.

template <class T> T* ptr(uintptr_t a) { return reinterpret_cast<T*>(a); }

// linear over every (activation dtype, weight format) pair; bf16 x bf16 on AVX512-BF16 takes the
// bf16-pair kernel.
template <class TX>
void linear_fmt(int wfmt, const TX* x, int64_t x_stride, int64_t M, int64_t K, const uint8_t* w, int64_t rb, int64_t N,
                const TX* bias, TX* out, int64_t out_stride) {
    if (wfmt & Q16_ACT) {
        switch (static_cast<WFormat>(wfmt & ~Q16_ACT)) {
            case WFormat::Q4_0X16: return linear_q8x16_impl<TX, FmtQ4_0, true>(x, x_stride, M, K, w, rb, N, bias, out, out_stride);
            case WFormat::Q4_1X16: return linear_q8x16_impl<TX, FmtQ4_1, true>(x, x_stride, M, K, w, rb, N, bias, out, out_stride);
            case WFormat::Q8_0X16: return linear_q8x16_impl<TX, FmtQ8_0, true>(x, x_stride, M, K, w, rb, N, bias, out, out_stride);
            default: throw std::invalid_argument("linear: 16-bit activations apply to interleaved GGUF block formats only, got format code " + std::to_string(wfmt & ~Q16_ACT));
        }
    }
    if (wfmt & Q8_ACT) {
        switch (static_cast<WFormat>(wfmt & ~Q8_ACT)) {
            case WFormat::Q4_0: return linear_q8_impl<TX, FmtQ4_0>(x, x_stride, M, K, w, rb, N, bias, out, out_stride);
            case WFormat::Q4_1: return linear_q8_impl<TX, FmtQ4_1>(x, x_stride, M, K, w, rb, N, bias, out, out_stride);
            case WFormat::Q8_0: return linear_q8_impl<TX, FmtQ8_0>(x, x_stride, M, K, w, rb, N, bias, out, out_stride);
            case WFormat::Q4_0X16: return linear_q8x16_impl<TX, FmtQ4_0, false>(x, x_stride, M, K, w, rb, N, bias, out, out_stride);
            case WFormat::Q4_1X16: return linear_q8x16_impl<TX, FmtQ4_1, false>(x, x_stride, M, K, w, rb, N, bias, out, out_stride);
            case WFormat::Q8_0X16: return linear_q8x16_impl<TX, FmtQ8_0, false>(x, x_stride, M, K, w, rb, N, bias, out, out_stride);
            default: throw std::invalid_argument("linear: int8 activations apply to GGUF block formats only, got format code " + std::to_string(wfmt & ~Q8_ACT));
        }
    }
    switch (static_cast<WFormat>(wfmt)) {
        case WFormat::F32: return linear_impl<TX, FmtF32>(x, x_stride, M, K, w, rb, N, bias, out, out_stride);
        case WFormat::BF16:
#ifdef __AVX512BF16__
            if constexpr (std::is_same_v<TX, uint16_t>)
                return linear_bf16_dp(x, x_stride, M, K, reinterpret_cast<const uint16_t*>(w), N, bias, out, out_stride);
#endif
            return linear_impl<TX, FmtBF16>(x, x_stride, M, K, w, rb, N, bias, out, out_stride);
        case WFormat::F16: return linear_impl<TX, FmtF16>(x, x_stride, M, K, w, rb, N, bias, out, out_stride);
        case WFormat::Q4_0: return linear_impl<TX, FmtQ4_0>(x, x_stride, M, K, w, rb, N, bias, out, out_stride);
        case WFormat::Q4_1: return linear_impl<TX, FmtQ4_1>(x, x_stride, M, K, w, rb, N, bias, out, out_stride);
        case WFormat::Q8_0: return linear_impl<TX, FmtQ8_0>(x, x_stride, M, K, w, rb, N, bias, out, out_stride);
        case WFormat::Q4_0X16:
        case WFormat::Q4_1X16:
        case WFormat::Q8_0X16: throw std::invalid_argument("linear: interleaved weights multiply against int8 or 16-bit activations only");
        case WFormat::BF16X16: return linear_bf16x16_impl<TX>(x, x_stride, M, K, w, N, bias, out, out_stride);
    }
    throw std::invalid_argument("linear: unknown weight format code " + std::to_string(wfmt));
}

template <class F> int64_t format_row_bytes(int64_t K) {
    if (K % F::BLOCK) throw std::invalid_argument("the row length " + std::to_string(K) + " is not a multiple of the format's block of " + std::to_string(F::BLOCK));
    return K / F::BLOCK * F::BYTES;
}

int64_t row_bytes(int wfmt, int64_t K) {  // the Q8_ACT / Q16_ACT flags do not change how weights are stored
    switch (static_cast<WFormat>(wfmt & ~(Q8_ACT | Q16_ACT))) {
        case WFormat::F32: return format_row_bytes<FmtF32>(K);
        case WFormat::BF16: return format_row_bytes<FmtBF16>(K);
        case WFormat::F16: return format_row_bytes<FmtF16>(K);
        case WFormat::Q4_0: return format_row_bytes<FmtQ4_0>(K);
        case WFormat::Q4_1: return format_row_bytes<FmtQ4_1>(K);
        case WFormat::Q8_0: return format_row_bytes<FmtQ8_0>(K);
        case WFormat::Q4_0X16: return format_row_bytes<FmtQ4_0>(K);
        case WFormat::Q4_1X16: return format_row_bytes<FmtQ4_1>(K);
        case WFormat::Q8_0X16: return format_row_bytes<FmtQ8_0>(K);
        case WFormat::BF16X16: return format_row_bytes<FmtBF16>(K);
    }
    throw std::invalid_argument("unknown weight format code " + std::to_string(wfmt));
}

void linear(int dtype, uintptr_t x, int64_t x_stride, int64_t M, int64_t K, int wfmt, uintptr_t w, int64_t rb, int64_t N,
            uintptr_t bias, uintptr_t out, int64_t out_stride) {
    if (rb != row_bytes(wfmt, K)) throw std::invalid_argument("linear: weight rows of " + std::to_string(rb) + " bytes do not hold K elements");
    py::gil_scoped_release release;
    const uint8_t* wp = ptr<const uint8_t>(w);
    with_dtype(dtype, "linear", [&](auto t) {
        using T = decltype(t);
        linear_fmt(wfmt, ptr<const T>(x), x_stride, M, K, wp, rb, N, ptr<const T>(bias), ptr<T>(out), out_stride);
    });
}

// rows (n,) int64 row indices of w (0: rows 0..n-1) -> out (n, K) rows out_stride apart, in fp32 or
// rounded to TO (bf16 for a prefill GEMM: one pass, without an fp32 copy of the whole weight).
template <class F, class TO> void dequantize_impl(const uint8_t* w, int64_t rb, int64_t K, const int64_t* rows, int64_t n, TO* out, int64_t out_stride) {
#pragma omp parallel if (n * K > 65536)
    {
        std::vector<float> row(std::is_same_v<TO, float> ? 0 : static_cast<size_t>(K));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; ++i) {
            const uint8_t* src = w + (rows ? rows[i] : i) * rb;
            if constexpr (std::is_same_v<TO, float>) {
                dequant_row<F>(src, K, out + i * out_stride);
            } else {
                dequant_row<F>(src, K, row.data());
                for (int64_t k = 0; k < K; ++k) out[i * out_stride + k] = from_f32<TO>(row[k]);
            }
        }
    }
}

template <class F> void dequantize_to(int out_dtype, const uint8_t* w, int64_t rb, int64_t K, const int64_t* rows, int64_t n, uintptr_t out, int64_t out_stride) {
    with_dtype(out_dtype, "dequantize (output)", [&](auto t) { dequantize_impl<F>(w, rb, K, rows, n, ptr<decltype(t)>(out), out_stride); });
}

template <class F, class TO> void dequantize_x16_impl(const uint8_t* w, int64_t rb, int64_t K, const int64_t* rows, int64_t n, TO* out, int64_t out_stride) {
#pragma omp parallel if (n * K > 65536)
    {
        std::vector<float> row(static_cast<size_t>(K));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; ++i) {
            const int64_t r = rows ? rows[i] : i;
            dequant_row_x16<F>(w + (r / X16) * X16 * rb, static_cast<int>(r % X16), K, row.data());
            int64_t k = 0;
#ifdef DART_V16
            if constexpr (std::is_same_v<TO, uint16_t>)
                for (; k + 8 <= K; k += 8) store8_bf16_rne(out + i * out_stride + k, _mm256_loadu_ps(row.data() + k));
#endif
            for (; k < K; ++k) out[i * out_stride + k] = from_f32<TO>(row[k]);
        }
    }
}

template <class F> void dequantize_x16_to(int out_dtype, const uint8_t* w, int64_t rb, int64_t K, const int64_t* rows, int64_t n, uintptr_t out, int64_t out_stride) {
    with_dtype(out_dtype, "dequantize (output)", [&](auto t) { dequantize_x16_impl<F>(w, rb, K, rows, n, ptr<decltype(t)>(out), out_stride); });
}

void dequantize(int wfmt, uintptr_t w, int64_t rb, int64_t K, int64_t n_rows, uintptr_t rows, int64_t n, uintptr_t out, int64_t out_stride,
                int out_dtype) {
    if (rb != row_bytes(wfmt, K)) throw std::invalid_argument("dequantize: weight rows of " + std::to_string(rb) + " bytes do not hold K elements");
    const int64_t* r = ptr<const int64_t>(rows);
    if (r)
        for (int64_t i = 0; i < n; ++i)
            if (r[i] < 0 || r[i] >= n_rows) throw std::invalid_argument("dequantize: row index " + std::to_string(r[i]) + " out of range");
    if (!r && n > n_rows) throw std::invalid_argument("dequantize: more rows than the weight has");
    py::gil_scoped_release release;
    const uint8_t* wp = ptr<const uint8_t>(w);
    switch (static_cast<WFormat>(wfmt)) {
        case WFormat::F32: return dequantize_to<FmtF32>(out_dtype, wp, rb, K, r, n, out, out_stride);
        case WFormat::BF16: return dequantize_to<FmtBF16>(out_dtype, wp, rb, K, r, n, out, out_stride);
        case WFormat::F16: return dequantize_to<FmtF16>(out_dtype, wp, rb, K, r, n, out, out_stride);
        case WFormat::Q4_0: return dequantize_to<FmtQ4_0>(out_dtype, wp, rb, K, r, n, out, out_stride);
        case WFormat::Q4_1: return dequantize_to<FmtQ4_1>(out_dtype, wp, rb, K, r, n, out, out_stride);
        case WFormat::Q8_0: return dequantize_to<FmtQ8_0>(out_dtype, wp, rb, K, r, n, out, out_stride);
        case WFormat::Q4_0X16: return dequantize_x16_to<FmtQ4_0>(out_dtype, wp, rb, K, r, n, out, out_stride);
        case WFormat::Q4_1X16: return dequantize_x16_to<FmtQ4_1>(out_dtype, wp, rb, K, r, n, out, out_stride);
        case WFormat::Q8_0X16: return dequantize_x16_to<FmtQ8_0>(out_dtype, wp, rb, K, r, n, out, out_stride);
        case WFormat::BF16X16:
            if (n_rows % X16) throw std::invalid_argument("dequantize: interleaved weights hold whole groups of 16 rows");
            return with_dtype(out_dtype, "dequantize (output)", [&](auto t) {
                dequantize_bf16x16_impl(reinterpret_cast<const uint16_t*>(wp), K, r, n, ptr<decltype(t)>(out), out_stride);
            });
    }
    throw std::invalid_argument("dequantize: unknown weight format code " + std::to_string(wfmt));
}

void add_rmsnorm(int dtype, uintptr_t x, uintptr_t delta, uintptr_t w, int64_t M, int64_t H, float eps, uintptr_t x_out,
                 uintptr_t normed) {
    py::gil_scoped_release release;
    with_dtype(dtype, "add_rmsnorm", [&](auto t) {
        using T = decltype(t);
        add_rmsnorm_impl(ptr<const T>(x), ptr<const T>(delta), ptr<const T>(w), M, H, eps, ptr<T>(x_out), ptr<T>(normed));
    });
}

void silu_mul(int dtype, uintptr_t gu, int64_t gu_stride, int64_t M, int64_t I, uintptr_t out) {
    py::gil_scoped_release release;
    with_dtype(dtype, "silu_mul", [&](auto t) {
        using T = decltype(t);
        silu_mul_impl(ptr<const T>(gu), gu_stride, M, I, ptr<T>(out));
    });
}

void tree_attention(int dtype, int cache_dtype, uintptr_t q, int64_t q_stride, uintptr_t k, int64_t k_stride, uintptr_t v,
                    int64_t v_stride, uintptr_t cos, uintptr_t sin, uintptr_t pos, uintptr_t k_cache,
                    uintptr_t v_cache, int64_t cap, int64_t P, int64_t T_, uintptr_t parents, int64_t nh, int64_t nkv,
                    int64_t hd, float scale, uintptr_t out, int64_t out_stride) {
    if (hd % 2 || nh % nkv) throw std::invalid_argument("tree_attention: head_dim must be even and nkv divide nh");
    if (P + T_ > cap) throw std::invalid_argument("tree_attention: the cache is too small");
    py::gil_scoped_release release;
    with_cache_dtype(dtype, cache_dtype, "tree_attention", [&](auto t, auto c) {
        using T = decltype(t);
        using C = decltype(c);
        tree_attention_impl(ptr<const T>(q), q_stride, ptr<const T>(k), k_stride, ptr<const T>(v), v_stride,
            ptr<const float>(cos), ptr<const float>(sin), ptr<const int64_t>(pos), ptr<C>(k_cache),
            ptr<C>(v_cache), cap, P, T_, ptr<const int64_t>(parents), nh, nkv, hd, scale,
            ptr<T>(out), out_stride);
    });
}

void rows_attention(int dtype, int cache_dtype, uintptr_t q, int64_t q_stride, uintptr_t k, int64_t k_stride, uintptr_t v, int64_t v_stride,
                    uintptr_t cos, uintptr_t sin, uintptr_t committed, uintptr_t k_cache, uintptr_t v_cache, int64_t seq_stride,
                    int64_t cap, int64_t B, int64_t nh, int64_t nkv, int64_t hd, float scale, uintptr_t out, int64_t out_stride) {
    if (hd % 2 || nkv < 1 || nh % nkv) throw std::invalid_argument("rows_attention: head_dim must be even and nkv divide nh");
    const int64_t* len = ptr<const int64_t>(committed);
    for (int64_t b = 0; b < B; ++b)
        if (len[b] < 0 || len[b] >= cap) throw std::invalid_argument("rows_attention: a sequence's cache is full");
    py::gil_scoped_release release;
    with_cache_dtype(dtype, cache_dtype, "rows_attention", [&](auto t, auto c) {
        using T = decltype(t);
        using C = decltype(c);
        rows_attention_impl(ptr<const T>(q), q_stride, ptr<const T>(k), k_stride, ptr<const T>(v), v_stride,
            ptr<const float>(cos), ptr<const float>(sin), len, ptr<C>(k_cache), ptr<C>(v_cache),
            seq_stride, cap, B, nh, nkv, hd, scale, ptr<T>(out), out_stride);
    });
}


// ------------------------------------------------------------------------------------- the decoder stack
// All decoder layers of one decode/verify forward in one call: the same kernels, in the same order, on
// the same buffers as the per-op path of dart_core/model.py (so the same bits), without ~100 us of
// Python and tensor allocation per layer: ~3 ms of a 9-15 ms forward of the 30-layer embedded target.
//
// plan (n_layers, PLAN_FIELDS) int64, one row a layer (dart_core/kernels.py LayerStack builds it):
// weight format, data pointer, row bytes of q|k|v, o, gate|up and down; the q|k|v bias (0: none); the
// two norms' weights. x (T, H) is the residual stream in, and out: the last layer's residual before
// its MLP output `pending` (T, H) is added (the final norm adds it). Captured residuals (the input of
// each layer in `capture`, after its attention norm's add) go to captured (T, n_capture * H).
// seq_stride 0: the T rows are one tree after P committed entries of one cache (tree_attention);
// seq_stride > 0: they are T separate sequences, row b's cache the slab at b * seq_stride within each
// layer and pos[b] its committed length and position (rows_attention).
enum PlanField : int64_t {
    QKV_FMT, QKV_W, QKV_RB, QKV_B, O_FMT, O_W, O_RB, W13_FMT, W13_W, W13_RB, W2_FMT, W2_W, W2_RB, ATT_NORM, FFN_NORM, PLAN_FIELDS
};

template <class T, class C>
void layers_forward_impl(const int64_t* plan, int64_t L, int64_t T_, int64_t H, int64_t I, int64_t nh, int64_t nkv,
                         int64_t hd, float eps, const float* cos, const float* sin, const int64_t* pos,
                         const int64_t* parents, int64_t P, C* k_cache, C* v_cache, int64_t layer_stride, int64_t seq_stride,
                         int64_t cap, T* x, T* pending, const int64_t* capture, int64_t n_capture, T* captured) {
    const int64_t q_out = nh * hd, kv_out = nkv * hd, qkv_n = q_out + 2 * kv_out;
    std::vector<T> h(T_ * H), qkv(T_ * qkv_n), o(T_ * q_out), gu(T_ * 2 * I), act(T_ * I);
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));  // as Python's 1.0 / math.sqrt(hd), rounded once
    bool have_pending = false;
    for (int64_t l = 0; l < L; ++l) {
        const int64_t* p = plan + l * PLAN_FIELDS;
        add_rmsnorm_impl<T>(x, have_pending ? pending : nullptr, ptr<const T>(p[ATT_NORM]), T_, H, eps, x, h.data());
        for (int64_t c = 0; c < n_capture; ++c)
            if (capture[c] == l)
                for (int64_t t = 0; t < T_; ++t) std::memcpy(captured + t * n_capture * H + c * H, x + t * H, H * sizeof(T));
        linear_fmt<T>(p[QKV_FMT], h.data(), H, T_, H, ptr<const uint8_t>(p[QKV_W]), p[QKV_RB], qkv_n, ptr<const T>(p[QKV_B]), qkv.data(), qkv_n);
        if (seq_stride == 0)
            tree_attention_impl<T, C>(qkv.data(), qkv_n, qkv.data() + q_out, qkv_n, qkv.data() + q_out + kv_out, qkv_n, cos, sin,
                                   pos, k_cache + l * layer_stride, v_cache + l * layer_stride, cap, P, T_, parents, nh, nkv, hd,
                                   scale, o.data(), q_out);
        else
            rows_attention_impl<T, C>(qkv.data(), qkv_n, qkv.data() + q_out, qkv_n, qkv.data() + q_out + kv_out, qkv_n, cos, sin,
                                   pos, k_cache + l * layer_stride, v_cache + l * layer_stride, seq_stride, cap, T_, nh, nkv,
                                   hd, scale, o.data(), q_out);
        linear_fmt<T>(p[O_FMT], o.data(), q_out, T_, q_out, ptr<const uint8_t>(p[O_W]), p[O_RB], H, nullptr, pending, H);
        add_rmsnorm_impl<T>(x, pending, ptr<const T>(p[FFN_NORM]), T_, H, eps, x, h.data());
        linear_fmt<T>(p[W13_FMT], h.data(), H, T_, H, ptr<const uint8_t>(p[W13_W]), p[W13_RB], 2 * I, nullptr, gu.data(), 2 * I);
        silu_mul_impl<T>(gu.data(), 2 * I, T_, I, act.data());
        linear_fmt<T>(p[W2_FMT], act.data(), I, T_, I, ptr<const uint8_t>(p[W2_W]), p[W2_RB], H, nullptr, pending, H);
        have_pending = true;
    }
}

void layers_forward(int dtype, int cache_dtype, uintptr_t plan, int64_t L, int64_t T_, int64_t H, int64_t I, int64_t nh, int64_t nkv, int64_t hd,
                    float eps, uintptr_t cos, uintptr_t sin, uintptr_t pos, uintptr_t parents, int64_t P, uintptr_t k_cache,
                    uintptr_t v_cache, int64_t layer_stride, int64_t seq_stride, int64_t cap, uintptr_t x, uintptr_t pending,
                    uintptr_t capture, int64_t n_capture, uintptr_t captured) {
    if (hd % 2 || nkv < 1 || nh % nkv) throw std::invalid_argument("layers_forward: head_dim must be even and nkv divide nh");
    if (seq_stride == 0 && P + T_ > cap) throw std::invalid_argument("layers_forward: the cache is too small");
    if (seq_stride != 0)
        for (int64_t b = 0; b < T_; ++b)
            if (ptr<const int64_t>(pos)[b] < 0 || ptr<const int64_t>(pos)[b] >= cap)
                throw std::invalid_argument("layers_forward: a sequence's cache is full");
    const int64_t* pl = ptr<const int64_t>(plan);
    const int64_t q_out = nh * hd, widths[4][2] = {{H, q_out + 2 * nkv * hd}, {q_out, H}, {H, 2 * I}, {I, H}};
    for (int64_t l = 0; l < L; ++l)
        for (int j = 0; j < 4; ++j) {
            const int64_t* f = pl + l * PLAN_FIELDS + j * 3 + (j > 0 ? 1 : 0);  // QKV_FMT, O_FMT, W13_FMT, W2_FMT
            if (f[2] != row_bytes(static_cast<int>(f[0]), widths[j][0]))
                throw std::invalid_argument("layers_forward: layer " + std::to_string(l) + ": weight rows do not hold " + std::to_string(widths[j][0]) + " elements");
        }
    py::gil_scoped_release release;
    with_cache_dtype(dtype, cache_dtype, "layers_forward", [&](auto t, auto c) {
        using T = decltype(t);
        using C = decltype(c);
        layers_forward_impl<T, C>(pl, L, T_, H, I, nh, nkv, hd, eps, ptr<const float>(cos), ptr<const float>(sin),
            ptr<const int64_t>(pos), ptr<const int64_t>(parents), P, ptr<C>(k_cache), ptr<C>(v_cache),
            layer_stride, seq_stride, cap, ptr<T>(x), ptr<T>(pending), ptr<const int64_t>(capture),
            n_capture, ptr<T>(captured));
    });
}

// ------------------------------------------------------------------------------------- a DART head's draft forward
// The DART head's whole draft forward in one call (dart_core/drafters/head.py KernelHead.draft): the
// ops of KernelHead.inputs, .layer and .logits, in their order and on the same kernels, without the
// ~15 Python kernel calls and tensor allocations a step around them. Drafts need no exactness (the
// verify decides); the tests compare it with those methods.
//
// plan (DRAFT_FIELDS) int64: format, data pointer and row bytes of fc, q|k|v, o, gate|up, down and
// the LM head, then the input, hidden, post-attention and final norms' weights and the mask vector
// (2H). aux (S, 3H) and emb (S, H): the S committed tokens' target states and embeddings, followed
// by D mask rows. The T = S + D rows' keys and values go to slots P.. of the head's one cache layer
// (nkv, cap, hd), each row attending to the prefix and the rows before it; the last D + 1 rows'
// logits go to logits (D + 1, Vd).
enum DraftField : int64_t {
    FC_FMT, FC_W, FC_RB, DQKV_FMT, DQKV_W, DQKV_RB, DO_FMT, DO_W, DO_RB, DGU_FMT, DGU_W, DGU_RB, DDOWN_FMT, DDOWN_W, DDOWN_RB,
    LM_FMT, LM_W, LM_RB, INPUT_NORM, HIDDEN_NORM, POST_NORM, FINAL_NORM, MASK_REP, DRAFT_FIELDS
};

template <class T>
void draft_forward_impl(const int64_t* pl, int64_t S, int64_t D, int64_t H, int64_t I, int64_t Vd, int64_t nh, int64_t nkv,
                        int64_t hd, float eps, bool double_norm, const T* aux, const T* emb, const float* cos, const float* sin,
                        int64_t P, T* k_cache, T* v_cache, int64_t cap, T* logits) {
    const int64_t T_ = S + D, keep = D + 1, q_out = nh * hd, kv_out = nkv * hd, qkv_n = q_out + 2 * kv_out;
    auto W = [&](int64_t f) { return ptr<const uint8_t>(pl[f]); };
    auto V = [&](int64_t f) { return ptr<const T>(pl[f]); };
    std::vector<T> g(S * H), e(S * H), nrm(S * H), scratch(T_ * H), u(T_ * 2 * H), res(T_ * H), qkv(T_ * qkv_n), att(T_ * q_out);
    std::vector<T> o(keep * H), h(keep * H), x(keep * H), gu(keep * 2 * I), act(keep * I), dn(keep * H), y(keep * H), z(keep * H);
    // inputs: g = fc(aux); u = [norm(emb) | norm(g)] with the residual g, then the mask rows, which
    // bypass both norms (u = mask, residual = its first H elements)
    linear_fmt<T>(pl[FC_FMT], aux, 3 * H, S, 3 * H, W(FC_W), pl[FC_RB], H, nullptr, g.data(), H);
    add_rmsnorm_impl<T>(emb, nullptr, V(INPUT_NORM), S, H, eps, scratch.data(), e.data());
    add_rmsnorm_impl<T>(g.data(), nullptr, V(HIDDEN_NORM), S, H, eps, scratch.data(), nrm.data());
    const T* mask = V(MASK_REP);
    for (int64_t t = 0; t < T_; ++t) {
        T* ut = u.data() + t * 2 * H;
        if (t < S) {
            std::memcpy(ut, e.data() + t * H, H * sizeof(T));
            std::memcpy(ut + H, nrm.data() + t * H, H * sizeof(T));
            std::memcpy(res.data() + t * H, g.data() + t * H, H * sizeof(T));
        } else {
            std::memcpy(ut, mask, 2 * H * sizeof(T));
            std::memcpy(res.data() + t * H, mask, H * sizeof(T));
        }
    }
    // the layer: causal attention after the cached prefix, then o and the MLP on the last `keep` rows
    linear_fmt<T>(pl[DQKV_FMT], u.data(), 2 * H, T_, 2 * H, W(DQKV_W), pl[DQKV_RB], qkv_n, nullptr, qkv.data(), qkv_n);
    std::vector<int64_t> pos(T_), parents(T_);
    for (int64_t t = 0; t < T_; ++t) pos[t] = P + t, parents[t] = t - 1;
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
    tree_attention_impl<T, T>(qkv.data(), qkv_n, qkv.data() + q_out, qkv_n, qkv.data() + q_out + kv_out, qkv_n, cos, sin, pos.data(),
                           k_cache, v_cache, cap, P, T_, parents.data(), nh, nkv, hd, scale, att.data(), q_out);
    linear_fmt<T>(pl[DO_FMT], att.data() + (T_ - keep) * q_out, q_out, keep, q_out, W(DO_W), pl[DO_RB], H, nullptr, o.data(), H);
    add_rmsnorm_impl<T>(res.data() + (T_ - keep) * H, o.data(), V(POST_NORM), keep, H, eps, h.data(), x.data());  // h = res + o
    linear_fmt<T>(pl[DGU_FMT], x.data(), H, keep, H, W(DGU_W), pl[DGU_RB], 2 * I, nullptr, gu.data(), 2 * I);
    silu_mul_impl<T>(gu.data(), 2 * I, keep, I, act.data());
    linear_fmt<T>(pl[DDOWN_FMT], act.data(), I, keep, I, W(DDOWN_W), pl[DDOWN_RB], H, nullptr, dn.data(), H);
    // logits: the final norm of h + down (twice for heads with double_norm), the LM head
    add_rmsnorm_impl<T>(h.data(), dn.data(), V(FINAL_NORM), keep, H, eps, y.data(), z.data());
    if (double_norm) {
        add_rmsnorm_impl<T>(z.data(), nullptr, V(FINAL_NORM), keep, H, eps, y.data(), x.data());
        z.swap(x);
    }
    linear_fmt<T>(pl[LM_FMT], z.data(), H, keep, H, W(LM_W), pl[LM_RB], Vd, nullptr, logits, Vd);
}

void draft_forward(int dtype, uintptr_t plan, int64_t S, int64_t D, int64_t H, int64_t I, int64_t Vd, int64_t nh, int64_t nkv,
                   int64_t hd, float eps, bool double_norm, uintptr_t aux, uintptr_t emb, uintptr_t cos, uintptr_t sin, int64_t P,
                   uintptr_t k_cache, uintptr_t v_cache, int64_t cap, uintptr_t logits) {
    if (S < 1 || D < 0) throw std::invalid_argument("draft_forward: needs at least one committed row and D >= 0 mask rows");
    if (hd % 2 || nkv < 1 || nh % nkv) throw std::invalid_argument("draft_forward: head_dim must be even and nkv divide nh");
    if (P < 0 || P + S + D > cap) throw std::invalid_argument("draft_forward: the cache is too small");
    const int64_t* pl = ptr<const int64_t>(plan);
    const int64_t q_out = nh * hd, widths[6][2] = {{3 * H, H}, {2 * H, q_out + 2 * nkv * hd}, {q_out, H}, {H, 2 * I}, {I, H}, {H, Vd}};
    for (int j = 0; j < 6; ++j)
        if (pl[3 * j + 2] != row_bytes(static_cast<int>(pl[3 * j]), widths[j][0]))
            throw std::invalid_argument("draft_forward: weight " + std::to_string(j) + "'s rows do not hold " + std::to_string(widths[j][0]) + " elements");
    py::gil_scoped_release release;
    with_dtype(dtype, "draft_forward", [&](auto t) {
        using T = decltype(t);
        draft_forward_impl<T>(pl, S, D, H, I, Vd, nh, nkv, hd, eps, double_norm, ptr<const T>(aux), ptr<const T>(emb),
            ptr<const float>(cos), ptr<const float>(sin), P, ptr<T>(k_cache), ptr<T>(v_cache), cap,
            ptr<T>(logits));
    });
}

// What the CPU running this process offers (the loader picks a build with it; x86 only).
py::dict cpu_features() {
    py::dict d;
#ifdef DART_X86
    __builtin_cpu_init();
    d["avx2"] = static_cast<bool>(__builtin_cpu_supports("avx2"));
    d["fma"] = static_cast<bool>(__builtin_cpu_supports("fma"));
    d["avx512f"] = static_cast<bool>(__builtin_cpu_supports("avx512f"));
    d["avx512bw"] = static_cast<bool>(__builtin_cpu_supports("avx512bw"));
    d["avx512vl"] = static_cast<bool>(__builtin_cpu_supports("avx512vl"));
    d["avx512dq"] = static_cast<bool>(__builtin_cpu_supports("avx512dq"));
    d["avx512bf16"] = static_cast<bool>(__builtin_cpu_supports("avx512bf16"));
    d["avx512vnni"] = static_cast<bool>(__builtin_cpu_supports("avx512vnni"));
#endif
    return d;
}

}  // namespace

PYBIND11_MODULE(DART_KERNELS_MODULE, m) {
    m.doc() = "Batch-invariant CPU kernels for the target's decode / tree-verify forward (see cpu_kernels.cpp)";
    m.def("linear", &linear);
    m.def("dequantize", &dequantize);
    m.def("row_bytes", &row_bytes);
    m.def("silu_mul", &silu_mul);
    m.def("add_rmsnorm", &add_rmsnorm);
    m.def("tree_attention", &tree_attention);
    m.def("rows_attention", &rows_attention);
    m.def("layers_forward", &layers_forward);
    m.def("draft_forward", &draft_forward);
    m.attr("DRAFT_FIELDS") = static_cast<int64_t>(DRAFT_FIELDS);
    m.attr("PLAN_FIELDS") = static_cast<int64_t>(PLAN_FIELDS);
    m.attr("Q8_ACTIVATIONS") = Q8_ACT;
    m.attr("Q16_ACTIVATIONS") = Q16_ACT;
    m.def("num_threads", &n_threads);
    m.def("cpu_features", &cpu_features);
    m.attr("PATH") = DART_KERNELS_PATH;
#ifdef __AVX512BF16__
    m.attr("BF16_DOT") = true;
#else
    m.attr("BF16_DOT") = false;
#endif
}
