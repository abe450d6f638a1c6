// linear_fmt: the dispatch of a linear over (activation dtype, weight format code) to its family; and
// row_bytes, the bytes of a weight row in each format.
#include "linear.h"

namespace dart {

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

#define DART_LINEAR_FMT(TX) \
    template void linear_fmt<TX>(int, DART_LINEAR_PARAMS(TX));
DART_FOR_EACH_DTYPE(DART_LINEAR_FMT)

}  // namespace dart
