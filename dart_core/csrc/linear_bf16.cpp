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
#include "linear.h"

namespace dart {

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
        store_tile(res, X16, 1, mb, X16, bias, n0, out + m0 * out_stride, out_stride);
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
// 16-lane contract (kernels.h) with "pairs of bf16" in place of "fp32 fma" (so results differ from CPUs without
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
        store_tile(res, NB, 1, M, nb, bias, n0, out, out_stride);  // the same fp32 bias add and rounding as the four-wide store
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
            if (nb == NB) {  // four outputs a row at once: store_output's fp32 add and rounding, four lanes wide
                for (int64_t i = 0; i < mb; ++i) {
                    __m128 v = _mm_loadu_ps(res + i * NB);
                    if (bias) v = _mm_add_ps(v, bias4);
                    store4_bf16(out + (m0 + i) * out_stride + n0, v);
                }
                continue;
            }
            store_tile(res, NB, 1, mb, nb, bias, n0, out + m0 * out_stride, out_stride);
        }
    }
}
#endif

#define DART_LINEAR_BF16X16(TX) \
    template void linear_bf16x16_impl<TX>(const TX*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, const TX*, TX*, int64_t);
DART_FOR_EACH_DTYPE(DART_LINEAR_BF16X16)
#define DART_DEQUANTIZE_BF16X16(TO) \
    template void dequantize_bf16x16_impl<TO>(const uint16_t*, int64_t, const int64_t*, int64_t, TO*, int64_t);
DART_FOR_EACH_DTYPE(DART_DEQUANTIZE_BF16X16)

}  // namespace dart
