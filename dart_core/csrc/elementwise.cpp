// The element-wise kernels: the residual add fused with RMSNorm, and the gated activation.
#include "kernels.h"

namespace dart {

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

#define DART_ELEMENTWISE(T) \
    template void add_rmsnorm_impl<T>(const T*, const T*, const T*, int64_t, int64_t, float, T*, T*); \
    template void silu_mul_impl<T>(const T*, int64_t, int64_t, int64_t, T*);
DART_FOR_EACH_DTYPE(DART_ELEMENTWISE)

}  // namespace dart
