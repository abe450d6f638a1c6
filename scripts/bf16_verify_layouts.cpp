// How fast can an AVX2 CPU multiply R = 1..6 rows against bf16 weights? A standalone measurement of
// two weight layouts for a verify's linear, outside the package. The second became the kernels' BF16X16
// format (docs/engine.md, "bf16 without bf16 arithmetic"):
//
//   rows       the layout the kernels read today (N rows of K, one weight row at a time against the R
//              input rows; 2 + 2R loads for 2R FMAs per 16 weights, as linear_rows_f_avx2)
//   broadcast  16 weight rows interleaved ([N/16][K][16]); each input element is broadcast and meets
//              16 weight rows in one FMA pair, one chain per output (8 loads for 12 FMAs at R = 6)
//
// Both stream the same bytes. Build and run (2 threads, as the bench):
//
//   g++ -O3 -fopenmp -mavx2 -mfma -mf16c scripts/bf16_verify_layouts.cpp -o /tmp/bf16_layouts
//   OMP_NUM_THREADS=2 /tmp/bf16_layouts           # from memory: 196,608 x 576 (226 MB)
//   OMP_NUM_THREADS=1 /tmp/bf16_layouts 960       # from cache: 960 x 576 (1.1 MB)
//
// It prints the best of several passes per row count, in ms. The two layouts sum in different
// orders (the broadcast one is not the kernels' 16-lane contract), so only their speed is compared.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr int64_t K = 576;  // the embedded target's hidden size: the q|k|v, gate|up and LM head rows

__m256 bf16x8(const uint16_t* p) {  // 8 bf16 widened to fp32, exactly
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

float hsum(__m256 a, __m256 b) {
    const __m256 s = _mm256_add_ps(a, b);
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    x = _mm_hadd_ps(x, x);
    return _mm_cvtss_f32(_mm_hadd_ps(x, x));
}

// rows: weight row n against R input rows, 2R accumulators (lanes 0-7 and 8-15 of 16 elements)
template <int R>
void rows_layout(const float* x, const uint16_t* w, int64_t N, float* out) {
    constexpr int64_t AHEAD = 8;  // weight rows prefetched ahead, a line every 32 elements
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const uint16_t* wr = w + n * K;
        const uint16_t* pf = n + AHEAD < N ? w + (n + AHEAD) * K : nullptr;
        __m256 lo[R], hi[R];
        for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            if (pf && k % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(pf + k), _MM_HINT_T1);
            const __m256 wl = bf16x8(wr + k), wh = bf16x8(wr + k + 8);
            for (int i = 0; i < R; ++i) {
                lo[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + k), wl, lo[i]);
                hi[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + k + 8), wh, hi[i]);
            }
        }
        for (int i = 0; i < R; ++i) out[i * N + n] = hsum(lo[i], hi[i]);
    }
}

// broadcast: G groups of 16 weight rows at once (more independent chains for few input rows)
template <int R>
constexpr int groups_at_once() {
    return R == 1 ? 4 : R <= 3 ? 2 : 1;
}

template <int R>
void broadcast_layout(const float* x, const uint16_t* w, int64_t N, float* out) {
    constexpr int G = groups_at_once<R>();
    constexpr int64_t AHEAD = 16;  // blocks of G groups prefetched ahead, a line every other element
    const int64_t blocks = N / (16 * G), gstride = K * 16;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const uint16_t* wg = w + b * G * gstride;
        const uint16_t* pf = b + AHEAD < blocks ? w + (b + AHEAD) * G * gstride : nullptr;
        __m256 acc[G][R][2];
        for (int g = 0; g < G; ++g)
            for (int i = 0; i < R; ++i) acc[g][i][0] = acc[g][i][1] = _mm256_setzero_ps();
        const __m256i zero = _mm256_setzero_si256();
        for (int64_t k = 0; k < K; ++k) {
            __m256 wl[G], wh[G];
            for (int g = 0; g < G; ++g) {
                const uint16_t* p = wg + g * gstride + k * 16;
                if (pf && k % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(pf + g * gstride + k * 16), _MM_HINT_T1);
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
                wl[g] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));  // rows 0-3, 8-11 of the group
                wh[g] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));  // rows 4-7, 12-15
            }
            for (int i = 0; i < R; ++i) {
                const __m256 xb = _mm256_broadcast_ss(x + i * K + k);
                for (int g = 0; g < G; ++g) {
                    acc[g][i][0] = _mm256_fmadd_ps(xb, wl[g], acc[g][i][0]);
                    acc[g][i][1] = _mm256_fmadd_ps(xb, wh[g], acc[g][i][1]);
                }
            }
        }
        for (int g = 0; g < G; ++g)
            for (int i = 0; i < R; ++i) {
                float* o = out + i * N + (b * G + g) * 16;
                _mm256_storeu_ps(o, acc[g][i][0]);  // (the lane order is the unpack's; only speed matters here)
                _mm256_storeu_ps(o + 8, acc[g][i][1]);
            }
    }
}

template <class Fn>
double best_ms(Fn&& fn, int passes) {
    double best = 1e30;
    for (int p = 0; p < passes; ++p) {
        const auto t0 = std::chrono::steady_clock::now();
        fn();
        best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
}

template <int R>
void row(const std::vector<float>& x, const std::vector<uint16_t>& w, int64_t N, std::vector<float>& out, int passes) {
    const double a = best_ms([&] { rows_layout<R>(x.data(), w.data(), N, out.data()); }, passes);
    const double b = best_ms([&] { broadcast_layout<R>(x.data(), w.data(), N, out.data()); }, passes);
    std::printf("| %d | %.3f | %.3f | %.2f |\n", R, a, b, a / b);
}

}  // namespace

int main(int argc, char** argv) {
    const int64_t N = (argc > 1 ? std::atol(argv[1]) : 196608) / 64 * 64;  // whole blocks of 4 groups of 16
    if (N < 64) {
        std::fprintf(stderr, "usage: %s [weight rows, >= 64]\n", argv[0]);
        return 2;
    }
    std::vector<uint16_t> w(N * K);
    for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint16_t>(0x3f80 + i % 7);  // 1.0 .. 1.05
    std::vector<float> x(6 * K, 0.5f), out(6 * N);
    const int passes = N * K * 2 > (64 << 20) ? 15 : 400;
    std::printf("%lld x %lld bf16 weights (%.1f MB), %d threads, best of %d passes, ms\n\n", static_cast<long long>(N),
                static_cast<long long>(K), N * K * 2 / 1e6, omp_get_max_threads(), passes);
    std::printf("| input rows | rows layout | broadcast layout | ratio |\n|---|---|---|---|\n");
    row<1>(x, w, N, out, passes);
    row<2>(x, w, N, out, passes);
    row<3>(x, w, N, out, passes);
    row<4>(x, w, N, out, passes);
    row<5>(x, w, N, out, passes);
    row<6>(x, w, N, out, passes);
    return 0;
}
