// Weight formats: the codes the Python side passes (dart_core/kernels/formats.py), how a row of each is
// stored, and its exact dequantization (a row at a time, or 16 / 32 elements in V16 registers).
#pragma once

#include "vec.h"

namespace dart {

// Weight formats (dart_core/kernels/formats.py WEIGHT_FORMATS): the three float dtypes, then GGUF blocks.
// Q4_0X16 / Q4_1X16 / Q8_0X16: the same blocks with 16 weight rows interleaved (int8 or 16-bit
// activations only; linear_x16.cpp). BF16X16: bf16 with 16 rows interleaved element by element (CPUs
// without bf16 arithmetic; linear_bf16.cpp).
enum class WFormat : int { F32 = 0, BF16 = 1, F16 = 2, Q4_0 = 3, Q4_1 = 4, Q8_0 = 5, Q4_0X16 = 6, Q4_1X16 = 7, Q8_0X16 = 8, BF16X16 = 9 };

// Flags on a weight format code (the extension's Q8_ACTIVATIONS / Q16_ACTIVATIONS; contracts q8 and
// q16: linear_q8.cpp, linear.h):
constexpr int64_t Q8_ACT = 16;  // flag on a weight format code: multiply against int8 activations
// Flag on an interleaved weight's format code: multiply against 16-bit activations, held as two int8
// digits (contract q16, linear.h), ~256x finer than int8 at twice the integer dot products.
constexpr int64_t Q16_ACT = 32;
constexpr int64_t X16 = 16;  // weight rows per interleaved group

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

template <class F> int64_t format_row_bytes(int64_t K) {
    if (K % F::BLOCK) throw std::invalid_argument("the row length " + std::to_string(K) + " is not a multiple of the format's block of " + std::to_string(F::BLOCK));
    return K / F::BLOCK * F::BYTES;
}
// Bytes of one weight row of K elements in format code wfmt (flags ignored); throws on a bad K.
int64_t row_bytes(int wfmt, int64_t K);

}  // namespace dart
