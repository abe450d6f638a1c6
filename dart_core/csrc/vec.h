// The shared ground of every kernel: the build's instruction set (DART_V16_AVX512 / DART_V16_AVX2 /
// generic), the activation dtypes and their dispatch, exact conversions, the contract's fixed-order
// sums, and the 16-lane vector type V16 with its fixed reduction tree (kernels.h: the contract).
#pragma once

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
// GCC 12's own AVX-512 intrinsics (_mm512_undefined_* read a self-initialised variable, GCC bug
// 105593, fixed in GCC 13) raise -W(maybe-)uninitialized wherever they are inlined: silenced for the
// intrinsic headers' lines only, not for this project's code.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
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

namespace dart {

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

// Explicit instantiations over the activation dtypes (the translation units define their templates).
#define DART_FOR_EACH_DTYPE(X) X(float) X(uint16_t) X(_Float16)

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

#ifdef DART_V16
// exp_nonpositive on 8 fp32 lanes, its scalar steps one for one (the same constants, the same unfused
// multiplies and adds, the current rounding mode for nearbyint): each element gets the scalar bits.
// silu_mul (elementwise.cpp) and the softmax (attention.cpp) use it.
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
#endif

// [0, n) in tiles: f(std::integral_constant<int, T>{}, i) for items i..i+T-1, tiles of T = MAX, then one
// of the rest (1..MAX-1 items), so a kernel's tile size is a compile-time constant (its registers).
template <int R, class Fn> inline void rest_tile(int64_t n, int64_t i, Fn& f) {
    if constexpr (R > 0) {
        if (n == R) return f(std::integral_constant<int, R>{}, i);
        rest_tile<R - 1>(n, i, f);
    }
}
template <int MAX, class Fn> inline void tiles(int64_t n, Fn&& f) {
    int64_t i = 0;
    for (; i + MAX <= n; i += MAX) f(std::integral_constant<int, MAX>{}, i);
    rest_tile<MAX - 1>(n - i, i, f);
}

// A tensor's address as the bindings pass it.
template <class T> T* ptr(uintptr_t a) { return reinterpret_cast<T*>(a); }

}  // namespace dart
