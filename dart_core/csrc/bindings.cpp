// The Python module dart_core._cpu_kernels_<path> (one per instruction-set build, setup.py): argument
// checks, the dtype dispatch and the GIL release around each kernel.
#include <pybind11/pybind11.h>

#include "kernels.h"

#ifndef DART_KERNELS_MODULE  // set per build by setup.py
#define DART_KERNELS_MODULE _cpu_kernels_generic
#define DART_KERNELS_PATH "generic"
#endif

namespace py = pybind11;

namespace dart {

// Tensors cross as raw addresses (the Python side checks dtypes, shapes, contiguity and devices):
// the module needs no torch headers and builds in seconds.

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

int n_threads() {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
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

}  // namespace dart

using namespace dart;

PYBIND11_MODULE(DART_KERNELS_MODULE, m) {
    m.doc() = "Batch-invariant CPU kernels for the target's decode / tree-verify forward (see dart_core/csrc/kernels.h)";
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
    m.def("issue_rates", [] {
        py::dict d;
        for (const auto& [k, v] : issue_rates()) d[py::str(k)] = v;
        return d;
    });
    m.attr("PATH") = DART_KERNELS_PATH;
#ifdef __AVX512BF16__
    m.attr("BF16_DOT") = true;
#else
    m.attr("BF16_DOT") = false;
#endif
}
