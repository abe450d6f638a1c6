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
// (Q8Rows, the activation rows, and the q16 contract's constants are in linear.h.)
#include "linear.h"

namespace dart {

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
    const bool digits = !r.codes_only;  // (codes_only: Q8Rows::q16 alone)
    int8_t* q = digits ? r.q.data() + m * r.npair * 64 + b * 32 : nullptr;
    int8_t* q2 = wide && digits ? r.q2.data() + m * r.npair * 64 + b * 32 : nullptr;
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
    // the 32 codes (and digits) in vector registers, packed to bytes in order
    const __m256 vid = _mm256_set1_ps(id), hi = _mm256_set1_ps(qmax), lo = _mm256_set1_ps(-qmax);
    const __m256 a[4] = {a0, a1, a2, a3};
    __m256i ti[4], wh[4], sum = _mm256_setzero_si256();
    for (int h = 0; h < 4; ++h) {
        __m256 t = _mm256_round_ps(_mm256_mul_ps(a[h], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm256_and_ps(_mm256_cmp_ps(t, t, _CMP_ORD_Q), _mm256_min_ps(_mm256_max_ps(t, lo), hi));
        ti[h] = _mm256_cvtps_epi32(t);
        sum = _mm256_add_epi32(sum, ti[h]);
        // hi = nearbyint(t / 255) as t * (1 / 255): both within 2 ulp of the exact quotient, which is never
        // within 1 / 510 of a tie for |t| <= 32512 (linear.h), so both round to the same integer
        if (wide && digits)
            wh[h] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(1.0f / static_cast<float>(Q16_BASE))),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    s = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
    // 4 x 8 int32 in [-127, 127] -> 32 bytes in order (the packs work within 128-bit lanes)
    auto bytes = [](__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v0, v1), _mm256_packs_epi32(v2, v3));
        return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    };
    if (!wide) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes(ti[0], ti[1], ti[2], ti[3]));
    } else if (digits) {
        __m256i l[4];
        for (int h = 0; h < 4; ++h) l[h] = _mm256_sub_epi32(ti[h], _mm256_sub_epi32(_mm256_slli_epi32(wh[h], 8), wh[h]));  // Q - 255 hi
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes(wh[0], wh[1], wh[2], wh[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q2), bytes(l[0], l[1], l[2], l[3]));
    }
    if (!r.q16.empty()) {  // the codes themselves, per 4 elements in the order (Q0, Q2, Q1, Q3) (Q8Rows::q16)
        const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15, 0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10,
                                               11, 14, 15);
        int16_t* o = r.q16_at(m, b);
        for (int h = 0; h < 2; ++h) {  // elements 16h..16h+15: (0-3, 8-11 | 4-7, 12-15) -> in order, then each 4 reordered
            const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(ti[2 * h], ti[2 * h + 1]), 0xD8);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * h), _mm256_shuffle_epi8(p, order));
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

// Row m's block b of codes into Q8Rows::q16 from its digits, or its int8 codes (where quantize_block_vec does not).
inline void q16_block(Q8Rows& r, int64_t m, int64_t b) {
    const int8_t* hi = r.qrow(m) + b * 32;
    const int8_t* lo = r.digits == 2 ? r.qrow2(m) + b * 32 : nullptr;
    int16_t* o = r.q16_at(m, b);
    for (int k = 0; k < 32; k += 4) {
        int16_t q[4];
        for (int e = 0; e < 4; ++e) q[e] = static_cast<int16_t>(lo ? Q16_BASE * hi[k + e] + lo[k + e] : hi[k + e]);
        o[k] = q[0], o[k + 1] = q[2], o[k + 2] = q[1], o[k + 3] = q[3];
    }
}

constexpr int64_t QUANTIZE_PARALLEL_ROWS = 8;  // rows from which quantize_q8 splits its rows across the threads

// Row m of x into r (its blocks, their padding, its 16-bit codes); rowp: K floats of scratch.
template <class TX>
void quantize_row(const TX* x, int64_t x_stride, int64_t m, int64_t K, Q8Rows& r, float* rowp) {
    const int digits = r.digits;
    // the padding: a zero block after an odd block count (codes and scales) and zero sx past nb
    if (r.nb % 2) {
        if (!r.codes_only) std::fill_n(r.q.data() + m * r.npair * 64 + r.nb * 32, 32, int8_t{0});
        if (digits == 2 && !r.codes_only) std::fill_n(r.q2.data() + m * r.npair * 64 + r.nb * 32, 32, int8_t{0});
        std::fill_n(r.dx16.data() + m * r.npair * 16 + (r.nb / 2) * 16 + 8, 8, 0.0f);
    }
    std::fill(r.sx.data() + m * r.nb16 + r.nb, r.sx.data() + (m + 1) * r.nb16, 0.0f);
    load_row(x + m * x_stride, rowp, K);
    for (int64_t b = 0; b < r.nb; ++b) {
        const float* v = rowp + b * 32;
#ifdef DART_X86_Q8_VEC
        if (quantize_block_vec(v, r, m, b)) {
#ifndef DART_V16_AVX2
            if (!r.q16.empty()) q16_block(r, m, b);
#endif
            continue;
        }
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
        if (!r.q16.empty()) q16_block(r, m, b);
    }
}

template <class TX>
void quantize_q8(const TX* x, int64_t x_stride, int64_t M, int64_t K, Q8Rows& r, int digits, bool q16, bool codes_only, bool blocks) {
#ifndef DART_V16_AVX2
    codes_only = blocks = false;  // (only the AVX2 kernels read the codes alone; elsewhere q16 comes from the digits)
#endif
    if ((codes_only && (digits != 2 || !q16)) || (blocks && !codes_only))
        throw std::logic_error("quantize_q8: codes alone need digits 2 and q16, block-major codes need codes alone");
    r.K = K, r.nb = K / 32, r.npair = (r.nb + 1) / 2, r.nb16 = (r.nb + 15) / 16 * 16, r.digits = digits;
    r.codes_only = codes_only, r.q16_rows = blocks ? M : 0;
    // (uninitialized: quantize_row writes every element of its row, the padding included)
    r.q.resize(codes_only ? 0 : static_cast<size_t>(M * r.npair * 64));
    r.q2.resize(digits == 2 && !codes_only ? static_cast<size_t>(M * r.npair * 64) : 0);
    r.dx16.resize(static_cast<size_t>(M * r.npair * 16));
    r.sx.resize(static_cast<size_t>(M * r.nb16));
    r.isum.resize(static_cast<size_t>(M * r.nb));
    r.q16.resize(q16 ? static_cast<size_t>(M * K) : 0);
    if (M < QUANTIZE_PARALLEL_ROWS) {  // (no parallel region: ~120 linears a one-row step)
        std::vector<float> row(static_cast<size_t>(K));
        for (int64_t m = 0; m < M; ++m) quantize_row(x, x_stride, m, K, r, row.data());
        return;
    }
    // each row's codes are its own: the same bytes on any thread
#pragma omp parallel
    {
        std::vector<float> row(static_cast<size_t>(K));
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) quantize_row(x, x_stride, m, K, r, row.data());
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
                store_tile(res, NB, 1, mb, nb, bias, n0, out + m0 * out_stride, out_stride);
            }
        }
    }
#else
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n)
        for (int64_t m = 0; m < M; ++m) store_output(out + m * out_stride + n, q8_dot_ref<F>(xq, m, w + n * rb), bias, n);
#endif
}

#define DART_QUANTIZE_Q8(TX) \
    template void quantize_q8<TX>(const TX*, int64_t, int64_t, int64_t, Q8Rows&, int, bool, bool, bool);
DART_FOR_EACH_DTYPE(DART_QUANTIZE_Q8)
#define DART_LINEAR_Q8(TX) \
    template void linear_q8_impl<TX, FmtQ4_0>(DART_LINEAR_PARAMS(TX)); \
    template void linear_q8_impl<TX, FmtQ4_1>(DART_LINEAR_PARAMS(TX)); \
    template void linear_q8_impl<TX, FmtQ8_0>(DART_LINEAR_PARAMS(TX));
DART_FOR_EACH_DTYPE(DART_LINEAR_Q8)

}  // namespace dart
