// ------------------------------------------------------------------------------------- int8 activations, rows interleaved
// Q4_0 / Q4_1 weights re-laid out for int8 activations: the same bytes, the blocks of 16 consecutive
// weight rows interleaved so that one integer lane holds one weight row ("x16"). Per group of 16 rows
// and block b: the 16 scales (fp16, 32 bytes), Q4_1's 16 minimums (32 bytes), then 4 chunks of 64
// bytes: chunk j holds bytes 4j..4j+3 of each row's 16 code bytes, row after row. A chunk's low
// nibbles are elements 4j..4j+3 of the 16 rows, its high nibbles elements 16+4j..16+4j+3, so one
// integer dot product against 4 activation bytes broadcast to every lane advances 16 rows by 4
// elements, and 8 of them give each row's whole block sum in its own lane: per block and input row
// 8 dot products, one conversion and 2-3 float ops for 16 outputs, against ~5 instructions per output
// in the layout as stored (whose lanes are elements, reduced at the end). The weights stream as
// many bytes as before. Q8_0 (the LM head) the same way with 8 chunks of its 32 signed code bytes:
// chunk j holds elements 4j..4j+3 of the 16 rows (x16_group_q8_0 below says how signed codes meet
// the unsigned operand of the integer dot product).
//
// Contract (q8x16), per output (weight row n, input row m): acc = 0; for each block b in order:
// acc = fma(d_nb * dx_mb, float(sum_e code * q), acc); then acc = fma(o_nb, sx_mb, acc) with o = m
// (Q4_1) or -8 d (Q4_0, its codes taken unsigned); Q8_0 (signed codes) has no offset term. No lane
// reduction; every build the same bits.
#include "linear.h"

namespace dart {

constexpr int64_t X16_PREFETCH_GROUPS = 2;  // groups ahead (6-15 KB each), into L2
template <class F> constexpr int64_t x16_codes_at() { return std::is_same_v<F, FmtQ4_1> ? 64 : 32; }  // bytes of scales (+ minimums)
template <class F> constexpr int x16_chunks() { return std::is_same_v<F, FmtQ8_0> ? 8 : 4; }  // 64-byte code chunks a block
template <class F> constexpr int64_t x16_block_bytes() { return X16 * F::BYTES; }

// Four code bytes at p (activation codes, or a weight row's bytes of an interleaved chunk) as one word.
inline int32_t code_word(const void* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// Weight row `lane` of an interleaved group's block as its 32 codes (Q4: unsigned nibbles; Q8_0: the
// signed bytes), scale and offset term (Q8_0 has none).
template <class F> inline void x16_block_scalar(const uint8_t* gb, int lane, int32_t* c, float& d, float& o) {
    d = f16_at(gb + 2 * lane);
    o = std::is_same_v<F, FmtQ4_1> ? f16_at(gb + 32 + 2 * lane) : -8.0f * d;
    const uint8_t* codes = gb + x16_codes_at<F>();
    if constexpr (std::is_same_v<F, FmtQ8_0>) {
        o = 0.0f;
        for (int j = 0; j < 8; ++j)
            for (int t = 0; t < 4; ++t) c[4 * j + t] = static_cast<int8_t>(codes[j * 64 + lane * 4 + t]);
        return;
    }
    for (int j = 0; j < 4; ++j)
        for (int t = 0; t < 4; ++t) {
            const uint8_t byte = codes[j * 64 + lane * 4 + t];
            c[4 * j + t] = byte & 15, c[16 + 4 * j + t] = byte >> 4;
        }
}

// Elements [0, K) of weight row `lane` of a group as fp32 (the prefill's dequantization): the values
// dequant_row gives for the same block in the layout as stored.
template <class F> void dequant_row_x16(const uint8_t* group, int lane, int64_t K, float* out) {
#ifdef DART_V16
    // The same values 8 at a time (AVX2 + F16C + FMA, in both vector builds): the row's code bytes are
    // one 32-bit word per chunk, so a block's codes are 4 (Q8_0: 8) scalar loads; then the scalar
    // loop's exact operations (one fma, or one product after an exact integer offset) lane by lane.
    // ~3x the scalar loop's rate; a prompt prefill dequantizes every layer's linears once.
    for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* gb = group + b * x16_block_bytes<F>();
        const uint8_t* codes = gb + x16_codes_at<F>() + 4 * lane;
        const __m256 d = _mm256_set1_ps(f16_at(gb + 2 * lane));
        float* o8 = out + b * 32;
        if constexpr (std::is_same_v<F, FmtQ8_0>) {
            alignas(32) int32_t w[8];
            for (int j = 0; j < 8; ++j) w[j] = code_word(codes + j * 64);
            for (int h = 0; h < 4; ++h) {
                const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 2 * h)));
                _mm256_storeu_ps(o8 + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
            }
        } else {
            const __m128i v = _mm_setr_epi32(code_word(codes), code_word(codes + 64), code_word(codes + 128), code_word(codes + 192));
            const __m128i m4 = _mm_set1_epi8(0x0F);
            const __m128i nib[2] = {_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4)};  // elements 0-15, 16-31
            const __m256 off = _mm256_set1_ps(std::is_same_v<F, FmtQ4_1> ? f16_at(gb + 32 + 2 * lane) : 0.0f);
            for (int h = 0; h < 4; ++h) {
                __m256i q = _mm256_cvtepu8_epi32(h % 2 ? _mm_srli_si128(nib[h / 2], 8) : nib[h / 2]);
                if constexpr (std::is_same_v<F, FmtQ4_1>) {
                    _mm256_storeu_ps(o8 + 8 * h, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), off));
                } else {
                    q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));
                    _mm256_storeu_ps(o8 + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
                }
            }
        }
    }
#else
    for (int64_t b = 0; b < K / 32; ++b) {
        int32_t c[32];
        float d, o;
        x16_block_scalar<F>(group + b * x16_block_bytes<F>(), lane, c, d, o);
        for (int e = 0; e < 32; ++e)
            out[b * 32 + e] = std::is_same_v<F, FmtQ4_1>   ? std::fma(d, static_cast<float>(c[e]), o)
                              : std::is_same_v<F, FmtQ8_0> ? d * static_cast<float>(c[e])
                                                           : d * static_cast<float>(c[e] - 8);
    }
#endif
}

template <class F> float x16_dot_ref(const Q8Rows& x, int64_t m, const uint8_t* group, int lane) {
    float acc = 0.0f;
    const int8_t* xq = x.qrow(m);
    for (int64_t b = 0; b < x.nb; ++b) {
        int32_t c[32];
        float d, o;
        x16_block_scalar<F>(group + b * x16_block_bytes<F>(), lane, c, d, o);
        int32_t p = 0;
        for (int e = 0; e < 32; ++e) p += c[e] * xq[b * 32 + e];
        if (x.digits == 2) {
            int32_t p2 = 0;
            for (int e = 0; e < 32; ++e) p2 += c[e] * x.qrow2(m)[b * 32 + e];
            p = Q16_BASE * p + p2;
        }
        acc = std::fma(d * x.dxrow(m)[(b / 2) * 16 + (b % 2) * 8], static_cast<float>(p), acc);
        if constexpr (!std::is_same_v<F, FmtQ8_0>) acc = std::fma(o, x.sxrow(m)[b], acc);
    }
    return acc;
}

#ifdef DART_V16
// Four activation codes (one 32-bit word, code_word) to every lane, straight from memory: a broadcast
// load, no ALU port. Copying a block's 32 codes to a local array first made GCC move them through
// general registers (a 64-bit load, a shift and a register broadcast per word), and the broadcasts
// competed with the dot products for the vector ports.
#if defined(DART_V16_AVX512)
inline __m512i bcast_word512(const int8_t* p) { return _mm512_set1_epi32(code_word(p)); }
#else
inline __m256i bcast_word256(const int8_t* p) { return _mm256_set1_epi32(code_word(p)); }
#endif

inline float q8_dx(const Q8Rows& x, int64_t m, int64_t b) { return x.dxrow(m)[(b / 2) * 16 + (b % 2) * 8]; }
// q16: a block's integer sum from its two digits' sums, 255 * hi + lo (exact in int32)
#if defined(DART_V16_AVX512)
inline __m512i q16_join(__m512i hi, __m512i lo) { return _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(hi, 8), hi), lo); }
#else
inline __m256i q16_join(__m256i hi, __m256i lo) { return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(hi, 8), hi), lo); }
#endif

#if defined(DART_V16_AVX512)
constexpr int64_t X16_MB = 16;  // input rows per pass: 16 accumulators + 8 code registers + scales of 32
// Q8_0 (the LM head / tied embedding): 8 chunks of signed codes. With VNNI the codes go in as c + 128
// (unsigned, one xor a block for all rows) and 128 * (the activation block's code sum) comes off the
// integer sum; without it, |c| against the activations with c's signs (pair sums <= 2 * 128 * 127,
// exact in int16). Either way the exact integer sum_e c * q of the contract.
template <int R, bool Wide>
void x16_group_q8_0(const Q8Rows& x, int64_t m0, const uint8_t* group, float* res, const uint8_t* pf) {
    constexpr int64_t BB = x16_block_bytes<FmtQ8_0>();
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < x.nb; ++b) {
        const uint8_t* gb = group + b * BB;
        if (pf)
            for (int64_t o = 0; o < BB; o += 64) prefetch_l2(pf + b * BB + o);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb)));
        const uint8_t* codes = gb + x16_codes_at<FmtQ8_0>();
#ifdef __AVX512VNNI__
        __m512i u[8];
        for (int j = 0; j < 8; ++j) u[j] = _mm512_xor_si512(_mm512_loadu_si512(codes + j * 64), _mm512_set1_epi8(static_cast<char>(0x80)));
#endif
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
            const int8_t* xq = x.qrow(m0 + i) + b * 32;
#ifdef __AVX512VNNI__
            auto dot = [&](const int8_t* xp) {
                __m512i p = _mm512_setzero_si512(), p1 = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int j = 0; j < 8; j += 2) {
                    p = _mm512_dpbusd_epi32(p, u[j], bcast_word512(xp + 4 * j));
                    p1 = _mm512_dpbusd_epi32(p1, u[j + 1], bcast_word512(xp + 4 * j + 4));
                }
                return _mm512_add_epi32(p, p1);
            };
            __m512i p = dot(xq);
            if constexpr (Wide) p = q16_join(p, dot(x.qrow2(m0 + i) + b * 32));
            // isum is the block's code sum (q16: of Q), so this takes off 128 * sum Q of the joined digits
            p = _mm512_sub_epi32(p, _mm512_set1_epi32(128 * x.isrow(m0 + i)[b]));
#else
            auto dot = [&](const int8_t* xp) {
                __m512i p = _mm512_setzero_si512();
                for (int j = 0; j < 8; ++j) {
                    const __m512i c = _mm512_loadu_si512(codes + j * 64), xb = bcast_word512(xp + 4 * j);
                    const __m512i xs = _mm512_mask_sub_epi8(xb, _mm512_movepi8_mask(c), _mm512_setzero_si512(), xb);
                    p = _mm512_add_epi32(p, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(c), xs), _mm512_set1_epi16(1)));
                }
                return p;
            };
            __m512i p = dot(xq);
            if constexpr (Wide) p = q16_join(p, dot(x.qrow2(m0 + i) + b * 32));
#endif
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(q8_dx(x, m0 + i, b))), _mm512_cvtepi32_ps(p), acc[i]);
        }
    }
    for (int i = 0; i < R; ++i) _mm512_storeu_ps(res + i * X16, acc[i]);
}

// R input rows against one group of 16 weight rows; out rows out_stride apart (16 outputs each).
template <class F, int R, bool Wide>
void x16_group(const Q8Rows& x, int64_t m0, const uint8_t* group, float* res, const uint8_t* pf) {
    if constexpr (std::is_same_v<F, FmtQ8_0>) return x16_group_q8_0<R, Wide>(x, m0, group, res, pf);
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < x.nb; ++b) {
        const uint8_t* gb = group + b * x16_block_bytes<F>();
        if (pf)  // the same block of a group PREFETCH_BLOCKS ahead, a line at a time between the arithmetic
            for (int64_t o = 0; o < x16_block_bytes<F>(); o += 64) prefetch_l2(pf + b * x16_block_bytes<F>() + o);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb)));
        const __m512 o = std::is_same_v<F, FmtQ4_1> ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 32)))
                                                      : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
        const uint8_t* codes = gb + x16_codes_at<F>();
        __m512i lo[4], hi[4];
        for (int j = 0; j < 4; ++j) {
            const __m512i c = _mm512_loadu_si512(codes + j * 64);
            lo[j] = _mm512_and_si512(c, m4);
            hi[j] = _mm512_and_si512(_mm512_srli_epi16(c, 4), m4);
        }
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
            const int8_t* xq = x.qrow(m0 + i) + b * 32;
#ifdef __AVX512VNNI__
            // two integer accumulators (low and high nibbles): half the dependency chain, the same exact sum
            auto dot = [&](const int8_t* xp) {
                __m512i p = _mm512_setzero_si512(), p1 = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int j = 0; j < 4; ++j) {
                    p = _mm512_dpbusd_epi32(p, lo[j], bcast_word512(xp + 4 * j));
                    p1 = _mm512_dpbusd_epi32(p1, hi[j], bcast_word512(xp + 16 + 4 * j));
                }
                return _mm512_add_epi32(p, p1);
            };
#else
            auto dot = [&](const int8_t* xp) {
                const __m512i one = _mm512_set1_epi16(1);
                __m512i p = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int j = 0; j < 4; ++j)
                    p = _mm512_add_epi32(p, _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(lo[j], bcast_word512(xp + 4 * j)),
                                                                                _mm512_maddubs_epi16(hi[j], bcast_word512(xp + 16 + 4 * j))), one));
                return p;
            };
#endif
            __m512i p = dot(xq);
            if constexpr (Wide) p = q16_join(p, dot(x.qrow2(m0 + i) + b * 32));
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(q8_dx(x, m0 + i, b))), _mm512_cvtepi32_ps(p), acc[i]);
            acc[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(x.sxrow(m0 + i)[b]), acc[i]);
        }
    }
    for (int i = 0; i < R; ++i) _mm512_storeu_ps(res + i * X16, acc[i]);
}
#else  // AVX2: the group as two halves of 8 rows (the first and second 32 bytes of each 64-byte chunk)
constexpr int64_t X16_MB = 6;  // 6 accumulators + 8 code registers + scales of 16 ymm
// Up to this many input rows, a group runs block by block with both halves inside each block (2R
// accumulators), so every 64-byte line is used once, as it arrives; past it, half by half (R
// accumulators, the codes of a block-half in registers), the second half re-reading the group from
// L1. The one-row step is memory-bound, and half by half its demand loads stopped for the whole
// second pass: forced AVX2 on the AMD EPYC, the layers of a one-row gguf-int16 step 5.0 -> 4.3 ms
// and the Q8_0 LM head 1.7 -> 1.3 ms (its memory limit). More rows than this spill the 2R
// accumulators past the 16 ymm registers and run slower fused. Q8_0 keeps no codes in registers.
// (16-bit codes on Q4 come here as one row only: from 2 rows, x16_group_q4_q16_few, and from
// X16_Q4_ROWS_Q16_MIN rows x16_group_q4_q16_rows.)
constexpr int X16_FUSED_ROWS_Q4 = 3;
constexpr int X16_FUSED_ROWS_Q8_0 = 6;

// A group block-half's 8 scales d (every format's first 32 bytes of a block: 16 fp16 scales).
inline __m256 x16_scale(const uint8_t* gb, int half) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 16 * half)));
}

// One block-half (8 weight rows) of a Q8_0 group against R input rows, into acc[R]:
// |c| against the activations with c's signs (pair sums exact in int16), a chunk at a time.
template <int R, bool Wide>
inline void x16_half_q8_0(const Q8Rows& x, int64_t m0, int64_t b, const uint8_t* gb, int half, __m256* acc) {
    const __m256i one = _mm256_set1_epi16(1);
    const __m256 d = x16_scale(gb, half);
    const uint8_t* codes = gb + x16_codes_at<FmtQ8_0>() + 32 * half;
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
        const int8_t* xq = x.qrow(m0 + i) + b * 32;
        auto dot = [&](const int8_t* xp) {
            __m256i p = _mm256_setzero_si256();
            for (int j = 0; j < 8; ++j) {
                const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64));
                const __m256i s = _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(bcast_word256(xp + 4 * j), c));
                p = _mm256_add_epi32(p, _mm256_madd_epi16(s, one));
            }
            return p;
        };
        __m256i p = dot(xq);
        if constexpr (Wide) p = q16_join(p, dot(x.qrow2(m0 + i) + b * 32));
        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(q8_dx(x, m0 + i, b))), _mm256_cvtepi32_ps(p), acc[i]);
    }
}

// A Q4 group block-half's 8 scales d and its offset term o (Q4_1's minimums, Q4_0's -8 d).
template <class F> inline void x16_scales(const uint8_t* gb, int half, __m256& d, __m256& o) {
    d = x16_scale(gb, half);
    o = std::is_same_v<F, FmtQ4_1> ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 32 + 16 * half)))
                                   : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
}

// A Q4 chunk's 32 code bytes (8 weight rows x 4) widened to int16 for vpmaddwd against 16-bit codes Q
// (Q8Rows::q16): w[0] the low nibbles of each row's bytes 0 and 2 (elements 4j, 4j + 2), w[1] of bytes
// 1 and 3 (4j + 1, 4j + 3), w[2] and w[3] the high nibbles' (16 + 4j..).
// The contract's float step of a Q4 block for one input row, in its order: acc + (d dx) float(p), then
// + o sx (the offset term against the row's code sum). Every AVX2 Q4 kernel takes it.
inline __m256 q4_block_step(__m256 d, __m256 o, __m256 dx, __m256 sx, __m256i p, __m256 acc) {
    return _mm256_fmadd_ps(o, sx, _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(p), acc));
}
inline void q4_widen16(__m256i c, __m256i* w) {
    const __m256i m4 = _mm256_set1_epi16(0x000F);
    w[0] = _mm256_and_si256(c, m4);
    w[1] = _mm256_and_si256(_mm256_srli_epi16(c, 8), m4);
    w[2] = _mm256_and_si256(_mm256_srli_epi16(c, 4), m4);
    w[3] = _mm256_srli_epi16(c, 12);
}

// The offset in a row's 32 codes Q of a block (Q8Rows::q16's order) of the pair word that meets kind k
// of chunk j's widened codes (q4_widen16): elements 4j, 4j + 2 (k = 0), 4j + 1, 4j + 3 (1), and the same
// 16 on (2, 3).
constexpr int q4_pair_word(int j, int k) { return (k / 2) * 16 + 4 * j + (k % 2) * 2; }

// One block-half (8 weight rows) of a Q4_0 / Q4_1 group, ready for input rows: its scales, its offset
// term (Q4_1's minimums, Q4_0's -8 d) and its 4 code chunks unpacked to low and high nibbles.
template <class F> struct Q4Half {
    __m256 d, o;
    __m256i lo[4], hi[4];
    Q4Half(const uint8_t* gb, int half) {
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        x16_scales<F>(gb, half, d, o);
        const uint8_t* codes = gb + x16_codes_at<F>() + 32 * half;
        for (int j = 0; j < 4; ++j) {
            const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64));
            lo[j] = _mm256_and_si256(c, m4);
            hi[j] = _mm256_and_si256(_mm256_srli_epi16(c, 4), m4);
        }
    }
    // The 8 rows' exact integer block sums against one input row's 32 codes at xp (int32 lanes), in
    // two chains of 16-bit sums (half the dependency chain; an exact sum in any order). Each 16-bit sum
    // holds at most 8 products pairs: 8 * 2 * 15 * 127 = 30480, no saturation.
    __m256i dot(const int8_t* xp) const {
        __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], bcast_word256(xp)), _mm256_maddubs_epi16(hi[0], bcast_word256(xp + 16)));
        __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[1], bcast_word256(xp + 4)), _mm256_maddubs_epi16(hi[1], bcast_word256(xp + 20)));
        s0 = _mm256_add_epi16(s0, _mm256_add_epi16(_mm256_maddubs_epi16(lo[2], bcast_word256(xp + 8)), _mm256_maddubs_epi16(hi[2], bcast_word256(xp + 24))));
        s1 = _mm256_add_epi16(s1, _mm256_add_epi16(_mm256_maddubs_epi16(lo[3], bcast_word256(xp + 12)), _mm256_maddubs_epi16(hi[3], bcast_word256(xp + 28))));
        return _mm256_madd_epi16(_mm256_add_epi16(s0, s1), _mm256_set1_epi16(1));
    }
    // Input row m's block b (both digits with Wide) into acc: the contract's two fmas.
    template <bool Wide> __m256 step(const Q8Rows& x, int64_t m, int64_t b, __m256 acc) const {
        __m256i p = dot(x.qrow(m) + b * 32);
        if constexpr (Wide) p = q16_join(p, dot(x.qrow2(m) + b * 32));
        return q4_block_step(d, o, _mm256_set1_ps(q8_dx(x, m, b)), _mm256_set1_ps(x.sxrow(m)[b]), p, acc);
    }
};

// One block-half of a Q4_0 / Q4_1 group against R input rows, into acc[R].
template <class F, int R, bool Wide>
inline void x16_half_q4(const Q8Rows& x, int64_t m0, int64_t b, const uint8_t* gb, int half, __m256* acc) {
    const Q4Half<F> w(gb, half);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) acc[i] = w.template step<Wide>(x, m0 + i, b, acc[i]);
}

// Where 16-bit codes meet the codes Q themselves (Q8Rows::q16) instead of two digits: Q4 groups from
// X16_Q4_FEW_MIN_ROWS rows, widened in registers up to X16_Q4_FEW_MAX_ROWS rows a pass
// (x16_group_q4_q16_few), the Q8_0 head from X16_Q8_WIDE_MIN_ROWS widened in L1 (x16_groups_q16); one
// row, the digits.
constexpr int64_t X16_Q4_FEW_MIN_ROWS = 2;
constexpr int X16_Q4_FEW_MAX_ROWS = 4;  // 8 widened codes + 2 R sums: from 5 rows, two passes (x16_group)
constexpr int64_t X16_Q8_WIDE_MIN_ROWS = 3;
// From this many rows of int8 codes the Q8_0 head too runs x16_groups_q16, on the codes as 16-bit ones
// (Q8Rows::q16 holds int8 codes as they are): the same integer block sums, the same float step. On the
// AMD EPYC (avx2, 2 threads, the embedded head, gguf-int8) against the int8 register kernel: 64 rows
// 17.4-18.3 -> 14.1-14.2 ms, 16 rows 4.57 -> 3.97-4.08, 8 rows 2.31-2.32 -> 2.17-2.24; 2-4 rows slower
// (2 rows 0.70-0.78 -> 0.88-0.90), 6 rows even.
constexpr int64_t X16_Q8_I8_WIDE_MIN_ROWS = 8;
template <class F> constexpr int64_t x16_q16_min_rows() {
    return std::is_same_v<F, FmtQ8_0> ? X16_Q8_WIDE_MIN_ROWS : X16_Q4_FEW_MIN_ROWS;
}

// 2-4 rows of 16-bit codes against a whole Q4_0 / Q4_1 group (AVX2), block by block as the fused
// kernel runs (every line used once, as it arrives): per chunk, both halves' codes widened to int16 in 8
// registers, met by each row's codes Q (Q8Rows::q16) in vpmaddwd, one broadcast feeding both halves; no
// 16-bit sums, widening or digit join. The integer sums are the digits' exact sum c * Q and the float
// steps per output the contract's in its order: the same bits. Q4 row counts from 2 to
// X16_Q4_ROWS_Q16_MIN - 1 run here: 2-4 rows (DART's and EAGLE3's verify of 1-3 drafted nodes) in one
// pass, more a row block of up to X16_MB rows at a time in two passes (x16_group), the second reading
// the group from L1; more rows take x16_group_q4_q16_rows. Up to there, widening a chunk again each
// pass costs less than widening the group's blocks once into L1 for every row and reading them back
// (x16_groups_q16, which the Q4 groups ran from 5 rows before): on the AMD EPYC (avx2, 2
// threads), the 30 layers' linears of 5 rows 9.8-10.2 -> 7.0-7.1 ms, 8 rows 13.2-13.9 -> 9.8-10.0, 16
// rows 21.7-22.2 -> 18.5-18.9, 64 rows 70.5-72.6 -> 69.5-69.9. When this kernel came (for 2-4 rows), a
// forward of 2 rows 7.3-7.7 -> 5.0-5.8 ms, 3 rows 8.9-9.1 -> 6.2-7.6, 4 rows 9.7-9.8 -> 7.6-8.9.
template <class F, int R>
void x16_group_q4_q16_few(const Q8Rows& x, int64_t m0, const uint8_t* group, float* res, const uint8_t* pf) {
    constexpr int64_t BB = x16_block_bytes<F>();
    const int64_t K = x.nb * 32;
    __m256 acc[R][2];  // [row][half]
    for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < x.nb; ++b) {
        const uint8_t* gb = group + b * BB;
        if (pf)
            for (int64_t o = 0; o < BB; o += 64) prefetch_l2(pf + b * BB + o);
        const uint8_t* codes = gb + x16_codes_at<F>();
        __m256i p[R][2];
        for (auto& q : p) q[0] = q[1] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
            __m256i w[2][4];  // [half][kind] (q4_widen16)
            for (int h = 0; h < 2; ++h) q4_widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64 + 32 * h)), w[h]);
            for (int r = 0; r < R; ++r) {
                const int16_t* xr = x.q16.data() + (m0 + r) * K + b * 32;
                for (int k = 0; k < 4; ++k) {  // words at 4j, 4j + 2, 16 + 4j, 16 + 4j + 2
                    const __m256i q = _mm256_set1_epi32(code_word(xr + q4_pair_word(j, k)));
                    for (int h = 0; h < 2; ++h) {
                        p[r][h] = _mm256_add_epi32(p[r][h], _mm256_madd_epi16(w[h][k], q));
                        asm("" : "+x"(p[r][h]));  // as in x16_groups_q16: no reassociation into spills
                    }
                }
            }
        }
        for (int h = 0; h < 2; ++h) {
            __m256 d, o;
            x16_scales<F>(gb, h, d, o);
            for (int r = 0; r < R; ++r)
                acc[r][h] = q4_block_step(d, o, _mm256_set1_ps(q8_dx(x, m0 + r, b)), _mm256_set1_ps(x.sxrow(m0 + r)[b]), p[r][h], acc[r][h]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(res + r * X16 + 8 * h, acc[r][h]);
}

// R input rows against one group of 16 weight rows (res: R x 16). Either loop order gives each
// output the same operations in the same order (its half's block after block).
template <class F, int R, bool Wide>
void x16_group(const Q8Rows& x, int64_t m0, const uint8_t* group, float* res, const uint8_t* pf) {
    constexpr bool q8 = std::is_same_v<F, FmtQ8_0>;
    if constexpr (!q8 && Wide && R >= X16_Q4_FEW_MIN_ROWS) {  // (its codes Q: linear_q8x16_impl)
        if constexpr (R <= X16_Q4_FEW_MAX_ROWS) return x16_group_q4_q16_few<F, R>(x, m0, group, res, pf);
        static_assert(R <= 2 * X16_Q4_FEW_MAX_ROWS, "a row block takes at most two passes");
        // two passes, the second over the group from L1
        x16_group_q4_q16_few<F, R / 2>(x, m0, group, res, pf);
        return x16_group_q4_q16_few<F, R - R / 2>(x, m0 + R / 2, group, res + (R / 2) * X16, nullptr);
    }
    constexpr int64_t BB = x16_block_bytes<F>();
    auto half_rows = [&](int64_t b, int half, __m256* acc) {
        if constexpr (q8)
            x16_half_q8_0<R, Wide>(x, m0, b, group + b * BB, half, acc);
        else
            x16_half_q4<F, R, Wide>(x, m0, b, group + b * BB, half, acc);
    };
    auto prefetch = [&](int64_t b) {  // the same block of a group X16_PREFETCH_GROUPS ahead
        if (pf)
            for (int64_t o = 0; o < BB; o += 64) prefetch_l2(pf + b * BB + o);
    };
    if constexpr (R <= (q8 ? X16_FUSED_ROWS_Q8_0 : X16_FUSED_ROWS_Q4)) {
        __m256 acc[2][R];
        for (int h = 0; h < 2; ++h)
            for (int i = 0; i < R; ++i) acc[h][i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < x.nb; ++b) {
            prefetch(b);
            half_rows(b, 0, acc[0]);
            half_rows(b, 1, acc[1]);
        }
        for (int h = 0; h < 2; ++h)
            for (int i = 0; i < R; ++i) _mm256_storeu_ps(res + i * X16 + 8 * h, acc[h][i]);
    } else {
        for (int half = 0; half < 2; ++half) {
            __m256 acc[R];
            for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
            for (int64_t b = 0; b < x.nb; ++b) {
                if (half == 0) prefetch(b);
                half_rows(b, half, acc);
            }
            for (int i = 0; i < R; ++i) _mm256_storeu_ps(res + i * X16 + 8 * half, acc[i]);
        }
    }
}
// Many rows of int8 codes against one Q4_0 / Q4_1 group (AVX2), both halves at once: per block, the
// group's codes split into their low and high nibbles once for all R rows (wb, 512 B in L1), then
// X16_Q4_I8_TILE rows at a time, each row's code word of a chunk broadcast once and met by both
// halves' nibble vectors (vpmaddubsw from L1: a broadcast feeds two products, where Q4Half::dot's
// feeds one). A lane's 16-bit sum over a block holds 8 pairs of products, as Q4Half::dot's (at most
// 8 * 2 * 15 * 127 = 30480: exact in any order), widened once a half; the float steps per output are
// q4_block_step, as the register kernels above: the same bits. On the AMD EPYC (avx2, 1
// thread, the embedded target's layer-0 linears) against one block-half at a time with its codes in
// registers and each row's Q4Half::dot: 64 rows 12-14% faster, 12-16 rows 5-10%, 8 rows even; tiles
// of 6 rows were slower than 4.
// (16-bit codes on Q4 take x16_group_q4_q16_few above and x16_group_q4_q16_rows below.)
constexpr int X16_Q4_I8_TILE = 4;
template <class F>
void x16_group_q4_i8_rows(const Q8Rows& x, int64_t m0, int64_t R, const uint8_t* group, float* acc, const uint8_t* pf) {
    constexpr int64_t BB = x16_block_bytes<F>();
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    alignas(32) uint8_t wb[8][2][32];  // [entry e: chunk e's low nibbles (e < 4), chunk e - 4's high ones][half]
    alignas(32) float ds[2][8], os[2][8];
    for (int64_t i = 0; i < R; ++i)
        for (int h = 0; h < 2; ++h) _mm256_store_ps(acc + i * X16 + 8 * h, _mm256_setzero_ps());
    const int64_t xs = x.npair * 64;
    for (int64_t b = 0; b < x.nb; ++b) {
        const uint8_t* gb = group + b * BB;
        if (pf)
            for (int64_t o = 0; o < BB; o += 64) prefetch_l2(pf + b * BB + o);
        const uint8_t* codes = gb + x16_codes_at<F>();
        for (int h = 0; h < 2; ++h) {
            __m256 d, o;
            x16_scales<F>(gb, h, d, o);
            _mm256_store_ps(ds[h], d), _mm256_store_ps(os[h], o);
            for (int j = 0; j < 4; ++j) {
                const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64 + 32 * h));
                _mm256_store_si256(reinterpret_cast<__m256i*>(wb[j][h]), _mm256_and_si256(c, m4));
                _mm256_store_si256(reinterpret_cast<__m256i*>(wb[4 + j][h]), _mm256_and_si256(_mm256_srli_epi16(c, 4), m4));
            }
        }
        const int8_t* xq = x.qrow(m0) + b * 32;  // row i's codes of block b at xq + i * xs
        auto rows = [&](auto rr, int64_t i) {
            constexpr int RR = decltype(rr)::value;
            __m256i s[RR][2];
            for (int r = 0; r < RR; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int e = 0; e < 8; ++e) {
                const int at = (e / 4) * 16 + 4 * (e % 4);  // Q4Half::dot's word for this entry
                const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wb[e][0]));
                const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wb[e][1]));
                for (int r = 0; r < RR; ++r) {
                    const __m256i q = _mm256_set1_epi32(code_word(xq + (i + r) * xs + at));
                    s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(w0, q));
                    s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(w1, q));
                    asm("" : "+x"(s[r][0]), "+x"(s[r][1]));  // each sum in its register
                }
            }
            for (int r = 0; r < RR; ++r) {
                const int64_t m = m0 + i + r;
                const __m256 dx = _mm256_set1_ps(q8_dx(x, m, b)), sx = _mm256_set1_ps(x.sxrow(m)[b]);
                for (int h = 0; h < 2; ++h) {
                    float* a = acc + (i + r) * X16 + 8 * h;
                    const __m256i p = _mm256_madd_epi16(s[r][h], ones);
                    _mm256_store_ps(a, q4_block_step(_mm256_load_ps(ds[h]), _mm256_load_ps(os[h]), dx, sx, p, _mm256_load_ps(a)));
                }
            }
        };
        tiles<X16_Q4_I8_TILE>(R, rows);
    }
}

constexpr int64_t X16_Q4_ROWS_MIN = 8;  // from this many rows of int8 codes, x16_group_q4_i8_rows
constexpr int64_t X16_ROWS_PASS = 64;   // rows per pass over a group (their float sums: up to 64 x 16 G in L1)

// The many-row kernels' driver: the groups split across the threads G at a time, up to X16_ROWS_PASS
// rows a pass over them, their float sums (rows x 16 ng) from group_sums(m0, rows, group, ng, acc, pf)
// for the ng <= G groups from `group`, then the bias and the store. pf: on a row block's first pass,
// the next G groups (nullptr past the end or on later passes), for the kernel to prefetch.
template <int G, class TX, class GroupSums>
void x16_rows(int64_t M, const uint8_t* w, int64_t rb, int64_t N, const TX* bias, TX* out, int64_t out_stride, GroupSums group_sums) {
    const int64_t groups = N / X16;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g += G) {
        const uint8_t* group = w + g * X16 * rb;
        const int ng = static_cast<int>(std::min<int64_t>(G, groups - g));
        alignas(32) float acc[X16_ROWS_PASS * X16 * G];
        const uint8_t* next = g + G < groups ? w + (g + G) * X16 * rb : nullptr;
        for (int64_t m0 = 0; m0 < M; m0 += X16_ROWS_PASS) {
            const int64_t mb = std::min(X16_ROWS_PASS, M - m0);
            group_sums(m0, mb, group, ng, acc, m0 == 0 ? next : nullptr);
            for (int i = 0; i < ng; ++i)
                store_tile(acc + i * X16, X16 * ng, 1, mb, X16, bias, (g + i) * X16, out + m0 * out_stride, out_stride);
        }
    }
}

// Many rows of 16-bit codes against the Q8_0 head (AVX2): each row's codes Q themselves (no digits,
// Q8Rows::q16) met by vpmaddwd against the weights' signed codes widened to int16, 8 weight rows by 2
// elements an instruction with exact int32 pair sums. Per block, G groups' 16 G weight rows are widened
// once for all R rows (w16, G KB in L1: for each 8-row vector, entry 2j the codes of elements 4j and
// 4j + 2 of each row's lane, entry 2j + 1 those of 4j + 1 and 4j + 3: chunk j's even and odd bytes),
// then each row's pairs are broadcast once and met by the 2G vectors
// straight from L1: one broadcast feeds 2G products of 16 multiply-adds. The digit kernel above feeds
// one vpmaddubsw of one digit a broadcast, and adds the 16-bit sums, widens them, joins the digits and
// fixes |c| and the signs. The integer sum sum_e c * Q is its, exact in int32 (|sum| <= 32 * 127 *
// 32512), and the float steps per output are the contract's in its order (block after block, the
// scale's fma), so each row gets the digit kernel's bits (tests/test_kernels.py: 1..20 and 70 rows
// against one row, every build). Used from X16_Q8_WIDE_MIN_ROWS rows of 16-bit codes and from
// X16_Q8_I8_WIDE_MIN_ROWS of int8 codes (the same integer sums as the int8 kernels), G = X16_WIDE_GROUPS.
constexpr int X16_WIDE_GROUPS = 2;


// R rows (from m0; R <= X16_ROWS_PASS) against G groups from `group` (gs bytes apart), into acc:
// R x 16 G floats, row i's vector v (weight rows 8v..8v+7 of the G groups) at (2 G i + v) * 8.
template <int G>
void x16_groups_q16(const Q8Rows& x, int64_t m0, int64_t R, const uint8_t* group, int64_t gs, float* acc, const uint8_t* pf) {
    using F = FmtQ8_0;
    constexpr int64_t BB = x16_block_bytes<F>();
    constexpr int V = 2 * G;  // 8-row vectors
    const int64_t K = x.nb * 32;
    // the pair word of entry e = 2j + k: Q of elements 4j, 4j + 2 (k = 0) or 4j + 1, 4j + 3 (k = 1)
    auto word = [](int e) { return 4 * (e / 2) + 2 * (e % 2); };
    alignas(32) int16_t w16[16][V][16];  // [entry][vector]
    for (int64_t i = 0; i < V * R; ++i) _mm256_store_ps(acc + i * 8, _mm256_setzero_ps());
    auto put = [&](int e, int v, __m256i c) { _mm256_store_si256(reinterpret_cast<__m256i*>(w16[e][v]), c); };
    for (int64_t b = 0; b < x.nb; ++b) {
        if (pf)  // the next G groups' block b, into L2 (the groups run from memory one after another)
            for (int g = 0; g < G; ++g)
                for (int64_t o = 0; o < BB; o += 64) prefetch_l2(pf + g * gs + b * BB + o);
        __m256 d[V];
        for (int v = 0; v < V; ++v) {
            const uint8_t* gb = group + (v / 2) * gs + b * BB;
            const uint8_t* codes = gb + x16_codes_at<F>() + 32 * (v % 2);
            d[v] = x16_scale(gb, v % 2);
            for (int j = 0; j < x16_chunks<F>(); ++j) {
                const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64));
                put(2 * j, v, _mm256_srai_epi16(_mm256_slli_epi16(c, 8), 8));
                put(2 * j + 1, v, _mm256_srai_epi16(c, 8));
            }
        }
        // rows RR at a time: each vector's codes loaded once for RR rows' products
        auto rows = [&](auto rr, int64_t i) {
            constexpr int RR = decltype(rr)::value;
            const int16_t* xr[RR];
            for (int r = 0; r < RR; ++r) xr[r] = x.q16.data() + (m0 + i + r) * K + b * 32;
            __m256i p[RR][V];
            for (int r = 0; r < RR; ++r)
                for (int v = 0; v < V; ++v) p[r][v] = _mm256_setzero_si256();
#pragma GCC unroll 16
            for (int e = 0; e < 16; ++e) {
                __m256i q[RR];
                for (int r = 0; r < RR; ++r) q[r] = _mm256_set1_epi32(code_word(xr[r] + word(e)));
                for (int v = 0; v < V; ++v) {
                    const __m256i c = _mm256_load_si256(reinterpret_cast<const __m256i*>(w16[e][v]));
                    for (int r = 0; r < RR; ++r) {
                        p[r][v] = _mm256_add_epi32(p[r][v], _mm256_madd_epi16(c, q[r]));
                        // each sum in its register as it goes: unpinned, GCC reassociates the products
                        // into a tree and spills most of them to the stack
                        asm("" : "+x"(p[r][v]));
                    }
                }
            }
            for (int r = 0; r < RR; ++r) {
                const __m256 dx = _mm256_broadcast_ss(x.dxrow(m0 + i + r) + (b / 2) * 16 + (b % 2) * 8);
                for (int v = 0; v < V; ++v) {
                    float* a = acc + (V * (i + r) + v) * 8;
                    _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_mul_ps(d[v], dx), _mm256_cvtepi32_ps(p[r][v]), _mm256_load_ps(a)));
                }
            }
        };
        tiles<2>(R, rows);
    }
}

// Rows a tile: 8 integer sums, 2 code vectors and a broadcast in registers. On the AMD EPYC (avx2, 1
// thread, the embedded target's layer-0 linears at 64 rows) 3, 4 and 5 rows ran 1.07-1.25 pairs a
// cycle alike, 6 (15 of 16 ymm) 0.9-1.0: its sums went to the stack around the float steps.
constexpr int X16_Q4_TILE = 4;
// From this many rows the many-row kernel; below, x16_group_q4_q16_few (2-4 rows a pass). Same
// machine and linears: at 4-8 rows the few-row kernel was 5-30% faster, at 12 they were even, at 16
// the many-row kernel 5-8% faster and at 64 rows 10-15% (1.15-1.25 pairs a cycle against 1.0-1.06).
constexpr int64_t X16_Q4_ROWS_Q16_MIN = 16;
// The rows' codes Q block-major as quantize_q8 wrote them (its `blocks`: block b's M rows together,
// (nb, M, 32)), and their scales dx and code sums sx copied block-major beside them, (nb, M). Row-major,
// the rows' 64 bytes of a block lie K * 2 bytes apart, and with K = 1536 (the down projection) those 64
// lines map to 4 of L1's 64 sets.
struct Q16Blocks {
    int64_t M = 0;
    const int16_t* q;
    RawVec<float> dx, sx;  // (uninitialized until the constructor's copy: every element is written)
    explicit Q16Blocks(const Q8Rows& x, int64_t M_) : M(M_), q(x.q16.data()), dx(x.nb * M_), sx(x.nb * M_) {
        if (x.q16_rows != M) throw std::logic_error("Q16Blocks: the codes must be block-major over the rows");
#pragma omp parallel for schedule(static) if (M * x.nb > 4096)
        for (int64_t m = 0; m < M; ++m)
            for (int64_t b = 0; b < x.nb; ++b) dx[b * M + m] = q8_dx(x, m, b), sx[b * M + m] = x.sxrow(m)[b];
    }
};

// Many rows of 16-bit codes against one Q4_0 / Q4_1 group (AVX2), rows innermost: per block, the
// group's two halves widened to int16 once for all R rows (w16, 1 KB in L1: entry 4j + k the kind k
// of chunk j as q4_widen16 gives it, for each half), then X16_Q4_TILE rows at a time, each entry's two
// vectors loaded once into registers and met by each row's broadcast pair word (the same word
// x16_group_q4_q16_few takes for that entry): 2 products of 16 multiply-adds a broadcast, X16_Q4_TILE
// rows' products a code vector load, and no widening per row block. The rows' codes come block-major (Q16Blocks), their
// float sums live in acc (row i's half h at acc + i * X16 + 8 h, L1). The integer sums are the
// few-row kernel's (exact, any order) and the float steps per output the contract's in its order:
// the same bits.
template <class F>
void x16_group_q4_q16_rows(const Q16Blocks& x, int64_t nb, int64_t m0, int64_t R, const uint8_t* group, float* acc, const uint8_t* pf) {
    constexpr int64_t BB = x16_block_bytes<F>();
    constexpr int64_t K = 32;  // (a row's codes of one block, block-major)
    alignas(32) int16_t w16[16][2][16];  // [entry][half]
    alignas(32) float ds[2][8], os[2][8];
    for (int64_t i = 0; i < R; ++i)
        for (int h = 0; h < 2; ++h) _mm256_store_ps(acc + i * X16 + 8 * h, _mm256_setzero_ps());
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* gb = group + b * BB;
        if (pf)
            for (int64_t o = 0; o < BB; o += 64) prefetch_l2(pf + b * BB + o);
        const uint8_t* codes = gb + x16_codes_at<F>();
        for (int h = 0; h < 2; ++h) {
            __m256 d, o;
            x16_scales<F>(gb, h, d, o);
            _mm256_store_ps(ds[h], d), _mm256_store_ps(os[h], o);
            for (int j = 0; j < 4; ++j) {
                __m256i w[4];
                q4_widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64 + 32 * h)), w);
                for (int k = 0; k < 4; ++k) _mm256_store_si256(reinterpret_cast<__m256i*>(w16[4 * j + k][h]), w[k]);
            }
        }
        // row i's pair words, scale and code sum at xq + i K, dxq[i], sxq[i]
        const int16_t* xq = x.q + (b * x.M + m0) * K;
        const float* dxq = x.dx.data() + b * x.M + m0;
        const float* sxq = x.sx.data() + b * x.M + m0;
        auto rows = [&](auto rr, int64_t i) {
            constexpr int RR = decltype(rr)::value;
            const int16_t* xr = xq + i * K;
            __m256i p[RR][2];
            for (int r = 0; r < RR; ++r) p[r][0] = p[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 16
            for (int e = 0; e < 16; ++e) {
                const int j = e / 4, k = e % 4;
                const __m256i c0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w16[e][0]));
                const __m256i c1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w16[e][1]));
                for (int r = 0; r < RR; ++r) {
                    const __m256i q = _mm256_set1_epi32(code_word(xr + r * K + q4_pair_word(j, k)));
                    p[r][0] = _mm256_add_epi32(p[r][0], _mm256_madd_epi16(c0, q));
                    p[r][1] = _mm256_add_epi32(p[r][1], _mm256_madd_epi16(c1, q));
                    asm("" : "+x"(p[r][0]), "+x"(p[r][1]));  // as in x16_groups_q16: no reassociation into spills
                }
            }
            for (int r = 0; r < RR; ++r) {
                const __m256 dx = _mm256_broadcast_ss(dxq + i + r), sx = _mm256_broadcast_ss(sxq + i + r);
                for (int h = 0; h < 2; ++h) {
                    float* a = acc + (i + r) * X16 + 8 * h;
                    _mm256_store_ps(a, q4_block_step(_mm256_load_ps(ds[h]), _mm256_load_ps(os[h]), dx, sx, p[r][h], _mm256_load_ps(a)));
                }
            }
        };
        tiles<X16_Q4_TILE>(R, rows);
    }
}
#endif

template <class F, bool Wide>
void x16_dispatch(int64_t mb, const Q8Rows& x, int64_t m0, const uint8_t* group, float* res, const uint8_t* pf) {
    switch (mb) {
#define DART_X16_CASE(r) \
    case r:              \
        if constexpr (r <= X16_MB) return x16_group<F, r, Wide>(x, m0, group, res, pf);
        DART_X16_CASE(1) DART_X16_CASE(2) DART_X16_CASE(3) DART_X16_CASE(4) DART_X16_CASE(5) DART_X16_CASE(6)
        DART_X16_CASE(7) DART_X16_CASE(8) DART_X16_CASE(9) DART_X16_CASE(10) DART_X16_CASE(11) DART_X16_CASE(12)
        DART_X16_CASE(13) DART_X16_CASE(14) DART_X16_CASE(15) DART_X16_CASE(16)
#undef DART_X16_CASE
    }
    throw std::logic_error("linear (interleaved rows): bad row block");
}
#endif

template <class TX, class F, bool Wide>
void linear_q8x16_impl(const TX* x, int64_t x_stride, int64_t M, int64_t K, const uint8_t* w, int64_t rb, int64_t N, const TX* bias,
                       TX* out, int64_t out_stride) {
    if (N % X16) throw std::invalid_argument("linear: interleaved weights hold whole groups of 16 rows, got " + std::to_string(N));
    Q8Rows xq;
#ifdef DART_V16_AVX2
    const bool q16 = Wide ? M >= x16_q16_min_rows<F>() : std::is_same_v<F, FmtQ8_0> && M >= X16_Q8_I8_WIDE_MIN_ROWS;
    // the codes alone where only they are read: the Q8_0 head's x16_groups_q16, and block-major for the
    // many-row Q4 kernel (Q16Blocks)
    const bool blocks = !std::is_same_v<F, FmtQ8_0> && Wide && M >= X16_Q4_ROWS_Q16_MIN;
    const bool codes_only = Wide && q16 && (std::is_same_v<F, FmtQ8_0> || blocks);
#else
    const bool q16 = false, codes_only = false, blocks = false;
#endif
    quantize_q8(x, x_stride, M, K, xq, Wide ? 2 : 1, q16, codes_only, blocks);
#ifdef DART_V16_AVX2
    if constexpr (std::is_same_v<F, FmtQ8_0>)
        if (q16) {  // (from X16_Q8_WIDE_MIN_ROWS rows)
            return x16_rows<X16_WIDE_GROUPS>(M, w, rb, N, bias, out, out_stride, [&](int64_t m0, int64_t mb, const uint8_t* group, int ng, float* acc, const uint8_t* pf) {
                if (ng == X16_WIDE_GROUPS)
                    x16_groups_q16<X16_WIDE_GROUPS>(xq, m0, mb, group, X16 * rb, acc, pf);
                else
                    x16_groups_q16<1>(xq, m0, mb, group, X16 * rb, acc, pf);
            });
        }
    if constexpr (!std::is_same_v<F, FmtQ8_0> && Wide)
        if (M >= X16_Q4_ROWS_Q16_MIN)
        {
            const Q16Blocks xb(xq, M);
            return x16_rows<1>(M, w, rb, N, bias, out, out_stride, [&](int64_t m0, int64_t mb, const uint8_t* group, int, float* acc, const uint8_t* pf) {
                x16_group_q4_q16_rows<F>(xb, xq.nb, m0, mb, group, acc, pf);
            });
        }
    if constexpr (!std::is_same_v<F, FmtQ8_0> && !Wide)
        if (M >= X16_Q4_ROWS_MIN)
            return x16_rows<1>(M, w, rb, N, bias, out, out_stride, [&](int64_t m0, int64_t mb, const uint8_t* group, int, float* acc, const uint8_t* pf) {
                x16_group_q4_i8_rows<F>(xq, m0, mb, group, acc, pf);
            });
#endif
#ifdef DART_V16
    const int64_t groups = N / X16;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* group = w + g * X16 * rb;
        const uint8_t* pf = g + X16_PREFETCH_GROUPS < groups ? w + (g + X16_PREFETCH_GROUPS) * X16 * rb : nullptr;
        float res[X16_MB * X16];
        for (int64_t m0 = 0, r = 0; m0 < M; m0 += row_block(M, r++, X16_MB)) {
            const int64_t mb = row_block(M, r, X16_MB);
            x16_dispatch<F, Wide>(mb, xq, m0, group, res, m0 == 0 ? pf : nullptr);
            store_tile(res, X16, 1, mb, X16, bias, g * X16, out + m0 * out_stride, out_stride);
        }
    }
#else
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n)
        for (int64_t m = 0; m < M; ++m)
            store_output(out + m * out_stride + n, x16_dot_ref<F>(xq, m, w + (n / X16) * X16 * rb, static_cast<int>(n % X16)), bias, n);
#endif
}

// rows (n,) of an interleaved block weight (nullptr: rows 0..n-1) -> out (n, K) rows out_stride apart,
// in fp32 or rounded to TO (bf16 for a prefill GEMM).
template <class F, class TO> void dequantize_x16_impl(const uint8_t* w, int64_t rb, int64_t K, const int64_t* rows, int64_t n, TO* out, int64_t out_stride) {
#pragma omp parallel if (n * K > 65536)
    {
        std::vector<float> row(static_cast<size_t>(K));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; ++i) {
            const int64_t r = rows ? rows[i] : i;
            dequant_row_x16<F>(w + (r / X16) * X16 * rb, static_cast<int>(r % X16), K, row.data());
            int64_t k = 0;
#ifdef DART_V16
            if constexpr (std::is_same_v<TO, uint16_t>)
                for (; k + 8 <= K; k += 8) store8_bf16_rne(out + i * out_stride + k, _mm256_loadu_ps(row.data() + k));
#endif
            for (; k < K; ++k) out[i * out_stride + k] = from_f32<TO>(row[k]);
        }
    }
}

#define DART_LINEAR_X16(TX) \
    template void linear_q8x16_impl<TX, FmtQ4_0, false>(DART_LINEAR_PARAMS(TX)); \
    template void linear_q8x16_impl<TX, FmtQ4_1, false>(DART_LINEAR_PARAMS(TX)); \
    template void linear_q8x16_impl<TX, FmtQ8_0, false>(DART_LINEAR_PARAMS(TX)); \
    template void linear_q8x16_impl<TX, FmtQ4_0, true>(DART_LINEAR_PARAMS(TX)); \
    template void linear_q8x16_impl<TX, FmtQ4_1, true>(DART_LINEAR_PARAMS(TX)); \
    template void linear_q8x16_impl<TX, FmtQ8_0, true>(DART_LINEAR_PARAMS(TX));
DART_FOR_EACH_DTYPE(DART_LINEAR_X16)
#define DART_DEQUANTIZE_X16(TO) \
    template void dequantize_x16_impl<FmtQ4_0, TO>(const uint8_t*, int64_t, int64_t, const int64_t*, int64_t, TO*, int64_t); \
    template void dequantize_x16_impl<FmtQ4_1, TO>(const uint8_t*, int64_t, int64_t, const int64_t*, int64_t, TO*, int64_t); \
    template void dequantize_x16_impl<FmtQ8_0, TO>(const uint8_t*, int64_t, int64_t, const int64_t*, int64_t, TO*, int64_t);
DART_FOR_EACH_DTYPE(DART_DEQUANTIZE_X16)

}  // namespace dart
