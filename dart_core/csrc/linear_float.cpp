// ------------------------------------------------------------------------------------- linear
// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]). x (M, K) rows `x_stride` apart; w: N rows of `rb`
// bytes in format F; out (M, N) rows `out_stride` apart. Every (m, n) is `dot(x[m], w[n])` of the
// contract, w[n] read exactly; blocks of NBV weight rows x MBV input rows only decide which dots run
// together, so a row's outputs never depend on M.
#include "linear.h"

namespace dart {

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
            store_tile(res, 1, M, M, n1 - n0, bias, n0, out, out_stride);
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
                store_tile(res, NB, 1, mb, nb, bias, n0, out + m0 * out_stride, out_stride);
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
            for (int64_t m = 0; m < M; ++m) store_output(out + m * out_stride + n, dot(xf.data() + m * K, wf.data(), K), bias, n);
        }
    }
}
#endif

#define DART_LINEAR_IMPL(TX) \
    template void linear_impl<TX, FmtF32>(DART_LINEAR_PARAMS(TX)); \
    template void linear_impl<TX, FmtBF16>(DART_LINEAR_PARAMS(TX)); \
    template void linear_impl<TX, FmtF16>(DART_LINEAR_PARAMS(TX)); \
    template void linear_impl<TX, FmtQ4_0>(DART_LINEAR_PARAMS(TX)); \
    template void linear_impl<TX, FmtQ4_1>(DART_LINEAR_PARAMS(TX)); \
    template void linear_impl<TX, FmtQ8_0>(DART_LINEAR_PARAMS(TX));
DART_FOR_EACH_DTYPE(DART_LINEAR_IMPL)

}  // namespace dart
