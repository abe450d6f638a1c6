// What the compute bound of a forward is made of on this CPU (dart-kernels --time, kernels/bound.py):
// the core clock, and how many of the kernels' arithmetic instructions a core issues per cycle at the
// build's vector width: the integer dot products (vpmaddubsw / vpmaddwd, VNNI's vpdpbusd), each of
// the first two with the add that accumulates its sums, the fp32 fma, and the dot product and fma
// mixed 1:1 (on several cores they share execution ports). Each rate is timed over
// independent dependency chains (more chains than latency x throughput), so it is the issue rate, not
// a latency.
#include <chrono>
#include <functional>

#include "kernels.h"

namespace dart {

namespace {

double seconds_now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Cycles per second: a chain of dependent 64-bit adds retires one add a cycle on every x86 core since
// the P6 (and on the ARM cores this builds for); best of 5 runs of ~20 ms, after a warm-up that lets
// the clock settle.
double clock_hz_impl() {
    constexpr int64_t N = 20'000'000;
    uint64_t x = 0;
    double best = 0.0;
    for (int run = 0; run < 6; ++run) {
        const double t0 = seconds_now();
        for (int64_t i = 0; i < N; ++i) {
#if defined(__x86_64__) || defined(__aarch64__)
#if defined(__x86_64__)
            asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
#else
            asm volatile("add %0, %0, #1\n\tadd %0, %0, #1\n\tadd %0, %0, #1\n\tadd %0, %0, #1" : "+r"(x));
#endif
#else
            x = x * 3 + 1;  // no assembly for this architecture: an estimate only (multiply latency)
#endif
        }
        const double hz = 4.0 * N / (seconds_now() - t0);
        if (run > 0) best = std::max(best, hz);
    }
    return x == 1 ? 0.0 : best;  // (x is never 1: keeps the loop)
}

#ifdef DART_V16
#if defined(DART_V16_AVX512)
using VI = __m512i;
using VF = __m512;
inline VI op_maddubs(VI a, VI b) { return _mm512_maddubs_epi16(a, b); }
inline VI op_madd(VI a, VI b) { return _mm512_madd_epi16(a, b); }
inline VI op_add16(VI a, VI b) { return _mm512_add_epi16(a, b); }
inline VI op_add32(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VF op_fma(VF a, VF b) { return _mm512_fmadd_ps(a, b, b); }
inline VI vi_set(int v) { return _mm512_set1_epi32(v); }
inline VF vf_set(float v) { return _mm512_set1_ps(v); }
#ifdef __AVX512VNNI__
inline VI op_dpbusd(VI acc, VI a) { return _mm512_dpbusd_epi32(acc, a, a); }
#endif
#else
using VI = __m256i;
using VF = __m256;
inline VI op_maddubs(VI a, VI b) { return _mm256_maddubs_epi16(a, b); }
inline VI op_madd(VI a, VI b) { return _mm256_madd_epi16(a, b); }
inline VI op_add16(VI a, VI b) { return _mm256_add_epi16(a, b); }
inline VI op_add32(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VF op_fma(VF a, VF b) { return _mm256_fmadd_ps(a, b, b); }
inline VI vi_set(int v) { return _mm256_set1_epi32(v); }
inline VF vf_set(float v) { return _mm256_set1_ps(v); }
#endif

// 12 independent chains of one step (an instruction, or a product and the add that accumulates it),
// each step fed by the chain's previous result (kept in registers by the empty asm), timed for `n`
// rounds: steps per second. 12 chains cover a step's latency at its issue rate, the product's plus
// the add's for a pair.
template <class V, class Op> double chains_rate(V seed, Op op, int64_t n) {
    V a0 = seed, a1 = seed, a2 = seed, a3 = seed, a4 = seed, a5 = seed, a6 = seed, a7 = seed, a8 = seed, a9 = seed, a10 = seed, a11 = seed;
    const double t0 = seconds_now();
    for (int64_t i = 0; i < n; ++i) {
        a0 = op(a0), a1 = op(a1), a2 = op(a2), a3 = op(a3), a4 = op(a4), a5 = op(a5);
        a6 = op(a6), a7 = op(a7), a8 = op(a8), a9 = op(a9), a10 = op(a10), a11 = op(a11);
        asm volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5));
        asm volatile("" : "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));
    }
    const double dt = seconds_now() - t0;
    asm volatile("" : : "x"(a0), "x"(a1), "x"(a2), "x"(a3), "x"(a4), "x"(a5));
    asm volatile("" : : "x"(a6), "x"(a7), "x"(a8), "x"(a9), "x"(a10), "x"(a11));
    return 12.0 * n / dt;
}

// 6 integer chains and 6 fma chains interleaved: instructions (of both kinds) per second.
template <class IOp> double mixed_rate(IOp iop, int64_t n) {
    VI a0 = vi_set(3), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    VF f0 = vf_set(1.0f), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0;
    const double t0 = seconds_now();
    for (int64_t i = 0; i < n; ++i) {
        a0 = iop(a0), f0 = op_fma(f0, f0), a1 = iop(a1), f1 = op_fma(f1, f1), a2 = iop(a2), f2 = op_fma(f2, f2);
        a3 = iop(a3), f3 = op_fma(f3, f3), a4 = iop(a4), f4 = op_fma(f4, f4), a5 = iop(a5), f5 = op_fma(f5, f5);
        asm volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5));
        asm volatile("" : "+x"(f0), "+x"(f1), "+x"(f2), "+x"(f3), "+x"(f4), "+x"(f5));
    }
    const double dt = seconds_now() - t0;
    asm volatile("" : : "x"(a0), "x"(a1), "x"(a2), "x"(a3), "x"(a4), "x"(a5));
    asm volatile("" : : "x"(f0), "x"(f1), "x"(f2), "x"(f3), "x"(f4), "x"(f5));
    return 12.0 * n / dt;
}

#endif

}  // namespace

// {"clock_hz", "lanes" (fp32 lanes of the build's vector), and per instruction kind its issue rate
// per cycle on one core: "maddubs", "madd", "fma", "madd_add" and "maddubs_add" (each product with
// the integer add that accumulates it, in pairs), "dot_fma_mix" (the build's dot product and fma
// 1:1), "dpbusd" with VNNI}. The generic build has no vector arithmetic: clock and lanes only.
std::vector<std::pair<std::string, double>> issue_rates() {
    std::vector<std::pair<std::string, double>> out;
    const double hz = clock_hz_impl();
    out.emplace_back("clock_hz", hz);
#ifdef DART_V16
    // Each rate is the best of PROBE_ROUNDS short runs, the kinds taken in turn round after round, so
    // that the runs of every kind spread over the whole measurement (~0.1 s): a moment when another thread shares
    // the core (a sibling hyperthread of the host, another tenant) slows every kind's run in it, and
    // best-of-4 runs back to back, one kind after the other, let such a moment take one kind's rate
    // down by a fifth to a third (seen on the AMD EPYC: vpmaddwd 1.55-1.73 against 2.02).
    constexpr int PROBE_ROUNDS = 24;
    constexpr int64_t n = 400'000;  // ~12 instructions x n, 1-2 ms a run
    const VI b = vi_set(0x01020304);
    auto per_cycle = [&](double per_s) { return hz > 0 ? per_s / hz : 0.0; };
#if defined(DART_V16_AVX512)
    out.emplace_back("lanes", 16);
#else
    out.emplace_back("lanes", 8);
#endif
    std::vector<std::pair<std::string, std::function<double()>>> kinds = {
        {"maddubs", [&] { return chains_rate(b, [&](VI a) { return op_maddubs(a, b); }, n); }},
        {"madd", [&] { return chains_rate(b, [&](VI a) { return op_madd(a, b); }, n); }},
        {"fma", [&] { return chains_rate(vf_set(1.0f), [&](VF a) { return op_fma(a, a); }, n); }},
        // a product with the add that accumulates its sums (without VNNI, AVX2's integer dot products
        // have no accumulating form): vpmaddwd + vpaddd, vpmaddubsw + vpaddw
        {"madd_add", [&] { return chains_rate(b, [&](VI a) { return op_add32(a, op_madd(a, b)); }, n); }},
        {"maddubs_add", [&] { return chains_rate(b, [&](VI a) { return op_add16(a, op_maddubs(a, b)); }, n); }},
#ifdef __AVX512VNNI__
        {"dpbusd", [&] { return chains_rate(b, [&](VI a) { return op_dpbusd(a, b); }, n); }},
        {"dot_fma_mix", [&] { return mixed_rate([&](VI a) { return op_dpbusd(a, b); }, n); }},
#else
        {"dot_fma_mix", [&] { return mixed_rate([&](VI a) { return op_maddubs(a, b); }, n); }},
#endif
    };
    std::vector<double> best(kinds.size(), 0.0);
    for (int round = 0; round <= PROBE_ROUNDS; ++round)  // (round 0 warms up: not counted)
        for (size_t k = 0; k < kinds.size(); ++k) {
            const double r = kinds[k].second();
            if (round > 0) best[k] = std::max(best[k], r);
        }
    for (size_t k = 0; k < kinds.size(); ++k) out.emplace_back(kinds[k].first, per_cycle(best[k]));
#else
    out.emplace_back("lanes", 1);
#endif
    return out;
}

}  // namespace dart
