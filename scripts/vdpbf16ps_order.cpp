// Which fp32 operation sequence does AVX512-BF16's vdpbf16ps compute? A standalone check behind
// docs/engine.md ("Not yet done", BF16X16 on AVX512-BF16 CPUs): it compares the instruction, lane by
// lane, with three orders over random bf16 pairs and fp32 accumulators (no denormals):
//   odd-then-even      acc = fma(a[2i+1], b[2i+1], acc); acc = fma(a[2i], b[2i], acc)
//   even-then-odd      the same, the even element first
//   pair-sum-then-acc  acc + (a[2i] * b[2i] + a[2i+1] * b[2i+1])
// bf16 x bf16 products are exact in fp32, so an fma of one is an fp32 add of the exact product.
// On the 2-core AMD EPYC (Zen 4) it printed 0 mismatches for odd-then-even over 3.2 M lanes.
//
//   g++ -O2 -mavx512f -mavx512bf16 -mfma -ffp-contract=off scripts/vdpbf16ps_order.cpp -o /tmp/vdpbf16ps_order
//   /tmp/vdpbf16ps_order
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

namespace {

float bf16_value(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

uint16_t bf16_truncated(float f) {  // any bf16 will do: the check needs bf16 inputs, not a rounding
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>(u >> 16);
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

}  // namespace

int main() {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0, 1);
    const auto value = [&] { return normal(rng) * std::pow(2.0f, static_cast<int>(normal(rng) * 4)); };  // spread exponents
    long lanes = 0, odd_first = 0, even_first = 0, pair_sum = 0;
    for (int it = 0; it < 200000; ++it) {
        alignas(64) uint16_t a[32], b[32];
        alignas(64) float acc[16], out[16];
        for (int i = 0; i < 32; ++i) a[i] = bf16_truncated(value()), b[i] = bf16_truncated(value());
        for (int i = 0; i < 16; ++i) acc[i] = value();
        _mm512_store_ps(out, _mm512_dpbf16_ps(_mm512_load_ps(acc), (__m512bh)_mm512_load_si512(a), (__m512bh)_mm512_load_si512(b)));
        for (int i = 0; i < 16; ++i, ++lanes) {
            const float a0 = bf16_value(a[2 * i]), a1 = bf16_value(a[2 * i + 1]), b0 = bf16_value(b[2 * i]), b1 = bf16_value(b[2 * i + 1]);
            odd_first += !same_bits(std::fmaf(a0, b0, std::fmaf(a1, b1, acc[i])), out[i]);
            even_first += !same_bits(std::fmaf(a1, b1, std::fmaf(a0, b0, acc[i])), out[i]);
            pair_sum += !same_bits(acc[i] + (a0 * b0 + a1 * b1), out[i]);
        }
    }
    std::printf("lanes %ld: odd-then-even fma mismatches %ld, even-then-odd %ld, pair-sum-then-acc %ld\n", lanes, odd_first, even_first,
                pair_sum);
    return 0;
}
