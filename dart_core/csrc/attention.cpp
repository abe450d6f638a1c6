// Attention with RoPE and the cache write in one call: a tree's rows over one sequence's cache
// (tree_attention_impl), and one new row for each of B separate sequences (rows_attention_impl).
#include "kernels.h"

namespace dart {

// ------------------------------------------------------------------------------------- tree attention
// One layer, new rows i = 0..T-1 after P committed cache entries.
//   q/k/v: row i at q + i*q_stride (nh*hd, heads contiguous), k + i*k_stride (nkv*hd), v likewise;
//          q and k are pre-RoPE.  cos/sin: fp32 tables (positions, hd/2); row i uses position pos[i].
//   k_cache/v_cache: (nkv, cap, hd) contiguous for this layer, of element type C (the activations' T, or
//          fp16 beside fp32 activations); row i is written at slot P+i, its key and value rounded to C.
//   parents[i]: the parent row of row i (-1 for the root).  Row i attends, in this order, to slots
//          0..P-1, its ancestors' slots from the root down, and its own slot: exactly the keys (and
//          the order) a one-token step would see once the ancestors are committed.
//   out: (T, nh*hd) rows out_stride apart.

// Attention's two inner loops, for the R query heads of one KV group (R = heads per group): each key
// and value row is loaded and converted once for up to four heads, and head r's arithmetic is exactly
// what it would be alone (scores: one key's lane tree; values: the keys in order per lane). Generic
// lane loops, and for head dims that are a multiple of 16 the same arithmetic in V16 registers.

#ifdef DART_V16
// Keys per block of key_scores_v and 16-lane groups per pass of weighted_values_v: as many as the
// registers hold (AVX2 has 16 ymm and a V16 takes two).
#if defined(DART_V16_AVX512)
constexpr int ATT_KEYS = 4, ATT_GROUPS = 4;
#else
constexpr int ATT_KEYS = 1, ATT_GROUPS = 2;
#endif
// Committed keys ahead that the two loops prefetch: the cache streams from memory at every step (the
// weights between two layers' attention evict it). On the AVX2 EPYC 8, 16 and 32 keys for the scores
// and 8 to 64 for the values measured the same (the passes' benchmark after 300 and 700 tokens).
constexpr int64_t ATT_PREFETCH = 8;

// The cache lines of n bytes at p into L1 (a key or value row, or a row's lane group)
inline void prefetch_bytes(const void* p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + o, _MM_HINT_T0);
}

// KEYS: keys a block (ATT_KEYS: as many as R heads' accumulators leave registers for; 4 for one head
// on any build). Streamed: the keys come from the cache (prefetched ahead), not from a copy in L1.
template <int R, class T, int KEYS = ATT_KEYS, bool Streamed = true>
void key_scores_v(const float* q, const T* kc, int64_t P, const std::vector<int64_t>& tl, int64_t L, int64_t hd,
                  float scale, float* out, int64_t out_stride) {
    const int64_t C = hd / LANES;
    int64_t j = 0;
    if constexpr (KEYS == 4) {
        for (; j + 4 <= L; j += 4) {  // four keys, their four lane trees reduced side by side
            if (Streamed && j + 4 + ATT_PREFETCH <= P) prefetch_bytes(kc + (j + ATT_PREFETCH) * hd, 4 * hd * static_cast<int64_t>(sizeof(T)));
            const T* kr[4];
            for (int u = 0; u < 4; ++u) kr[u] = kc + (j + u < P ? j + u : tl[j + u - P]) * hd;
            V16 acc[R][4];
            for (int r = 0; r < R; ++r)
                for (int u = 0; u < 4; ++u) acc[r][u] = v_zero();
            for (int64_t c = 0; c < C; ++c) {
                V16 kv[4];
                for (int u = 0; u < 4; ++u) kv[u] = v_load(kr[u] + c * LANES);
                for (int r = 0; r < R; ++r) {
                    const V16 qv = v_load(q + r * hd + c * LANES);
                    for (int u = 0; u < 4; ++u) acc[r][u] = v_fma(qv, kv[u], acc[r][u]);
                }
            }
            for (int r = 0; r < R; ++r)
                _mm_storeu_ps(out + r * out_stride + j, _mm_mul_ps(v_reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), _mm_set1_ps(scale)));
        }
    }
    for (; j < L; ++j) {
        if (Streamed && j + ATT_PREFETCH < P) prefetch_bytes(kc + (j + ATT_PREFETCH) * hd, hd * static_cast<int64_t>(sizeof(T)));
        const T* kr = kc + (j < P ? j : tl[j - P]) * hd;
        V16 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = v_zero();
        for (int64_t c = 0; c < C; ++c) {
            const V16 kv = v_load(kr + c * LANES);
            for (int r = 0; r < R; ++r) acc[r] = v_fma(v_load(q + r * hd + c * LANES), kv, acc[r]);
        }
        for (int r = 0; r < R; ++r) out[r * out_stride + j] = v_reduce(acc[r]) * scale;
    }
}

// G lane groups of R heads' weighted values in one pass over the keys. G is a template parameter so
// that the R x G accumulators stay in registers: with a run-time group count GCC kept them on the
// stack, a store and a load on every key's dependency chain (AVX2, two groups a pass: 700 keys'
// values of an fp16 cache 30 -> 20 us a layer; docs/engine.md, "An fp16 KV cache").
template <int R, int G, class T>
void weighted_values_g(const float* p, int64_t p_stride, const T* vc, int64_t P, const std::vector<int64_t>& tl, int64_t L,
                       int64_t hd, int64_t c0, float* out) {
    V16 acc[R][G];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < G; ++c) acc[r][c] = v_zero();
    // The committed keys, then the tail's slots: two loops, so that no committed key's step reads tl.
    // In one loop choosing between them, GCC stored every accumulator back to the stack at each key
    // (a store per accumulator per key: the values took ~60% of a 64-row prefill chunk's attention).
    const int64_t* tlp = tl.data();
    const int64_t n = std::min(P, L);
    auto step = [&acc, p, p_stride](int64_t j, const T* vr) __attribute__((always_inline)) {
        V16 pj[R];
        for (int r = 0; r < R; ++r) pj[r] = v_set1(p[r * p_stride + j]);
        for (int c = 0; c < G; ++c) {
            const V16 vv = v_load(vr + c * LANES);
            for (int r = 0; r < R; ++r) acc[r][c] = v_fma(pj[r], vv, acc[r][c]);
        }
    };
    for (int64_t j = 0; j < n; ++j) {
        if (j + ATT_PREFETCH < P) prefetch_bytes(vc + (j + ATT_PREFETCH) * hd + c0 * LANES, G * LANES * static_cast<int64_t>(sizeof(T)));
        step(j, vc + j * hd + c0 * LANES);
    }
    for (int64_t j = n; j < L; ++j) step(j, vc + tlp[j - P] * hd + c0 * LANES);
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < G; ++c) v_store(out + r * hd + (c0 + c) * LANES, acc[r][c]);
}

// Lane groups [g0, g1): ATT_GROUPS at a time, then pairs, then one by one (every lane's sum is over
// the keys in order however the groups are batched); `one`: one at a time (below, ATT_ONE_GROUP_ROWS).
template <int R, class T>
void weighted_values_v(const float* p, int64_t p_stride, const T* vc, int64_t P, const std::vector<int64_t>& tl, int64_t L,
                       int64_t hd, int64_t g0, int64_t g1, float* out, bool one) {
    int64_t c = g0;
    if (one) {
        for (; c < g1; ++c) weighted_values_g<R, 1>(p, p_stride, vc, P, tl, L, hd, c, out);
        return;
    }
    for (; c + ATT_GROUPS <= g1; c += ATT_GROUPS) weighted_values_g<R, ATT_GROUPS>(p, p_stride, vc, P, tl, L, hd, c, out);
    if constexpr (ATT_GROUPS > 2)
        for (; c + 2 <= g1; c += 2) weighted_values_g<R, 2>(p, p_stride, vc, P, tl, L, hd, c, out);
    for (; c < g1; ++c) weighted_values_g<R, 1>(p, p_stride, vc, P, tl, L, hd, c, out);
}
#endif

template <class T>
void key_scores(const float* q /* [R][hd] */, int64_t R, const T* kc, int64_t P, const std::vector<int64_t>& tl, int64_t L,
                int64_t hd, float scale, float* kf, float* out /* [R][out_stride] */, int64_t out_stride) {
#ifdef DART_V16
    if (hd % LANES == 0) {
        switch (R) {
            case 1: return key_scores_v<1>(q, kc, P, tl, L, hd, scale, out, out_stride);
            case 2: return key_scores_v<2>(q, kc, P, tl, L, hd, scale, out, out_stride);
            case 3: return key_scores_v<3>(q, kc, P, tl, L, hd, scale, out, out_stride);
            case 4: return key_scores_v<4>(q, kc, P, tl, L, hd, scale, out, out_stride);
            default:  // more heads per group: four at a time (each head's arithmetic is its own)
                for (int64_t r = 0; r < R; r += 4)
                    key_scores(q + r * hd, std::min<int64_t>(4, R - r), kc, P, tl, L, hd, scale, kf, out + r * out_stride, out_stride);
                return;
        }
    }
#endif
    for (int64_t j = 0; j < L; ++j) {
        load_row(kc + (j < P ? j : tl[j - P]) * hd, kf, hd);
        for (int64_t r = 0; r < R; ++r) out[r * out_stride + j] = dot(q + r * hd, kf, hd) * scale;
    }
}

// Lanes [LANES g0, LANES g1) of out (clipped to hd): each lane's sum is over the keys in order whatever
// the range, so a head's output can be computed a lane group at a time (tree_attention_impl does).
template <class T>
void weighted_values(const float* p /* [R][p_stride] */, int64_t p_stride, int64_t R, const T* vc, int64_t P,
                     const std::vector<int64_t>& tl, int64_t L, int64_t hd, float* vf, float* out /* [R][hd] */, int64_t g0,
                     int64_t g1, bool one = false) {
#ifdef DART_V16
    if (hd % LANES == 0) {
        switch (R) {
            case 1: return weighted_values_v<1>(p, p_stride, vc, P, tl, L, hd, g0, g1, out, one);
            case 2: return weighted_values_v<2>(p, p_stride, vc, P, tl, L, hd, g0, g1, out, one);
            case 3: return weighted_values_v<3>(p, p_stride, vc, P, tl, L, hd, g0, g1, out, one);
            case 4: return weighted_values_v<4>(p, p_stride, vc, P, tl, L, hd, g0, g1, out, one);
            default:
                for (int64_t r = 0; r < R; r += 4)
                    weighted_values(p + r * p_stride, p_stride, std::min<int64_t>(4, R - r), vc, P, tl, L, hd, vf, out + r * hd, g0, g1, one);
                return;
        }
    }
#else
    (void)one;
#endif
    const int64_t d0 = g0 * LANES, d1 = std::min(g1 * LANES, hd);
    for (int64_t r = 0; r < R; ++r) std::fill(out + r * hd + d0, out + r * hd + d1, 0.0f);
    for (int64_t j = 0; j < L; ++j) {
        load_row(vc + (j < P ? j : tl[j - P]) * hd + d0, vf + d0, d1 - d0);
        for (int64_t r = 0; r < R; ++r)
            for (int64_t d = d0; d < d1; ++d) out[r * hd + d] = std::fma(p[r * p_stride + j], vf[d], out[r * hd + d]);
    }
}

// e^(a[j] - mx) in place for j < n, exp_nonpositive's bits (8 lanes at a time where the build has them)
inline void exp_shifted(float* a, int64_t n, float mx) {
    int64_t j = 0;
#ifdef DART_V16
    const __m256 m = _mm256_set1_ps(mx);
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(a + j, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(a + j), m)));
#endif
    for (; j < n; ++j) a[j] = exp_nonpositive(a[j] - mx);
}

// max(a[0..n)) as the scalar fold mx = std::max(mx, a[j]) from mx = a[0] computes it (a NaN a[j] is
// skipped, a NaN a[0] kept): a maximum does not depend on the order it is taken in, so 16 lanes give
// the same value. The scalar fold is one dependent vmaxss per key: it was two thirds of the softmax.
inline float max_of(const float* a, int64_t n) {
    float mx = a[0];
    int64_t j = 1;
#if defined(DART_V16_AVX512)
    if (n >= 17) {
        __m512 m = _mm512_set1_ps(a[0]);
        for (; j + 16 <= n; j += 16) m = _mm512_max_ps(_mm512_loadu_ps(a + j), m);  // second operand kept on NaN
        float lanes[16];
        _mm512_storeu_ps(lanes, m);
        for (float l : lanes) mx = std::max(mx, l);
    }
#elif defined(DART_V16_AVX2)
    if (n >= 9) {
        __m256 m = _mm256_set1_ps(a[0]);
        for (; j + 8 <= n; j += 8) m = _mm256_max_ps(_mm256_loadu_ps(a + j), m);
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (float l : lanes) mx = std::max(mx, l);
    }
#endif
    for (; j < n; ++j) mx = std::max(mx, a[j]);
    return mx;
}

// One KV group's attention for its `rep` query heads (qf [rep][hd], RoPE applied, fp32) over the
// logical key sequence: slots 0..P-1 of kc/vc, then the slots listed in tl (L = P + tl.size() keys).
// Scores, softmax and values in the fixed order of the contract; writes head r's output to
// dst + r * hd. kf, vf [hd], scores [rep][max_len], acc [rep][hd] are the caller's scratch.
template <class C, class T>
void attend_group(const float* qf, int64_t rep, const C* kc, const C* vc, int64_t P, const std::vector<int64_t>& tl, int64_t L,
                  int64_t hd, float scale, float* kf, float* vf, float* scores, int64_t max_len, float* acc, T* dst) {
    key_scores(qf, rep, kc, P, tl, L, hd, scale, kf, scores, max_len);
    for (int64_t r = 0; r < rep; ++r) {
        float* sr = scores + r * max_len;
        exp_shifted(sr, L, max_of(sr, L));
    }
    weighted_values(scores, max_len, rep, vc, P, tl, L, hd, vf, acc, 0, (hd + LANES - 1) / LANES);
    for (int64_t r = 0; r < rep; ++r) {
        const float denom = sum(scores + r * max_len, L);
        for (int64_t d = 0; d < hd; ++d) dst[r * hd + d] = from_f32<T>(acc[r * hd + d] / denom);
    }
}

// A new row's key, RoPE in fp32 rounded to the cache dtype, and its value (rounded to it), written at
// `slot` of every KV group of one sequence's cache (nkv, cap, hd). c / s: the row's cos / sin (hd/2).
template <class T, class C>
inline void store_key_value(const T* k, const T* v, const float* c, const float* s, C* k_cache, C* v_cache, int64_t cap,
                            int64_t slot, int64_t nkv, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t g = 0; g < nkv; ++g) {
        const T* src = k + g * hd;
        C* dst = k_cache + (g * cap + slot) * hd;
        for (int64_t d = 0; d < half; ++d) {
            const float x1 = to_f32(src[d]), x2 = to_f32(src[d + half]);
            dst[d] = from_f32<C>(x1 * c[d] - x2 * s[d]);
            dst[d + half] = from_f32<C>(x2 * c[d] + x1 * s[d]);
        }
        if constexpr (std::is_same_v<T, C>) {
            std::memcpy(v_cache + (g * cap + slot) * hd, v + g * hd, hd * sizeof(T));
        } else {
            for (int64_t d = 0; d < hd; ++d) v_cache[(g * cap + slot) * hd + d] = from_f32<C>(to_f32(v[g * hd + d]));
        }
    }
}

// The `rep` query heads of one KV group (q: the group's first head), RoPE in fp32 and kept in fp32.
template <class T>
inline void rope_queries(const T* q, const float* c, const float* s, int64_t rep, int64_t hd, float* qf) {
    const int64_t half = hd / 2;
    for (int64_t r = 0; r < rep; ++r) {
        const T* src = q + r * hd;
        float* dst = qf + r * hd;
        for (int64_t d = 0; d < half; ++d) {
            const float x1 = to_f32(src[d]), x2 = to_f32(src[d + half]);
            dst[d] = x1 * c[d] - x2 * s[d];
            dst[d + half] = x2 * c[d] + x1 * s[d];
        }
    }
}

#if defined(DART_V16_AVX2)
// ------------------------------------------------------------------------------------- many rows in row blocks (AVX2)
// A verify's tree or a prompt's chunk of many rows, head dim 64: one work item per KV group and block
// of rows, each taking its rows' query heads (rows x heads per group, "query heads" below) through
// scores, softmax and values with every operand local. Per item the group's committed keys are
// widened to fp32 once for all its query heads, the keys 8 at a time transposed (a ymm holds one
// dimension of 8 keys), so that a score's lane tree runs with the 8 keys in the lanes: vertical fmas
// and adds, no horizontal reduction per key; the values widened once, then met by tiles of 6 query
// heads x 16 dims in registers. Each score is the contract's lane tree (lane l: q[16c + l] k[16c + l]
// fma'd over c from zero; then l + l+8, + l+4, + l+2, + l+1; times the scale) and each output lane the
// keys in order, so every row gets the bits of attend_group on its own.
constexpr int ATT_BLOCK_HD = 64;
constexpr int64_t ATT_BLOCK_KEYS = 64;     // committed keys widened and transposed at a time (16 KB of fp32: L1)
// Rows from which a tree runs in row blocks. Measured on the AVX2 EPYC (one layer of the embedded
// model's attention, fp16 cache flushed from the caches before each call as the weights do in a
// forward, 2 threads, the fastest of 3-5 runs alternating with the paths before): after 200 keys, 2
// rows 27.3 -> 29.9 us, 3 rows 35.1 -> 37.8, 4 rows 40.1 -> 39.5, 6 rows 53.8 -> 48.6, 8 rows 69.2 ->
// 62.0, 64 rows 503 -> 400; after 700, 4 rows 105 -> 115, 6 rows 140 -> 136, 8 rows 175 -> 150, 16
// rows 319 -> 267, 64 rows 1211 -> 995. Below this the widened keys serve too few query heads.
constexpr int64_t ATT_BLOCK_FROM_ROWS = 6;
constexpr int64_t ATT_BLOCK_MAX_ROWS = 16;  // rows an item takes at most (48 query heads' scores in L2)
constexpr int ATT_BLOCK_SCORE_HEADS = 4;    // query heads a scores tile shares its keys' loads with
constexpr int ATT_BLOCK_VALUE_HEADS = 6;    // query heads x 16 dims of a values tile: 12 accumulators

// Keys j0..j0+n-1 (n <= ATT_BLOCK_KEYS) of one group's cache as fp32, transposed in blocks of 8 keys:
// kt[(blk * hd + d) * 8 + u] = dimension d of key j0 + 8 blk + u (keys past n: zero).
template <class C> void transpose_keys(const C* kc, int64_t j0, int64_t n, float* kt) {
    constexpr int hd = ATT_BLOCK_HD;
    for (int64_t blk = 0; blk * 8 < n; ++blk) {
        for (int c = 0; c < hd / LANES; ++c) {
            __m256 r[2][8];  // [lo/hi 8 dims][key]
            for (int u = 0; u < 8; ++u) {
                const int64_t j = blk * 8 + u;
                const V16 k = j < n ? v_load(kc + (j0 + j) * hd + c * LANES) : v_zero();
                r[0][u] = k.lo, r[1][u] = k.hi;
            }
            for (int h = 0; h < 2; ++h) {  // 8 keys x 8 dims -> 8 dims x 8 keys
                __m256* a = r[h];
                const __m256 t0 = _mm256_unpacklo_ps(a[0], a[1]), t1 = _mm256_unpackhi_ps(a[0], a[1]);
                const __m256 t2 = _mm256_unpacklo_ps(a[2], a[3]), t3 = _mm256_unpackhi_ps(a[2], a[3]);
                const __m256 t4 = _mm256_unpacklo_ps(a[4], a[5]), t5 = _mm256_unpackhi_ps(a[4], a[5]);
                const __m256 t6 = _mm256_unpacklo_ps(a[6], a[7]), t7 = _mm256_unpackhi_ps(a[6], a[7]);
                const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
                const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
                const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
                const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
                float* o = kt + (blk * hd + c * LANES + 8 * h) * 8;
                _mm256_store_ps(o + 0 * 8, _mm256_permute2f128_ps(u0, u4, 0x20));
                _mm256_store_ps(o + 1 * 8, _mm256_permute2f128_ps(u1, u5, 0x20));
                _mm256_store_ps(o + 2 * 8, _mm256_permute2f128_ps(u2, u6, 0x20));
                _mm256_store_ps(o + 3 * 8, _mm256_permute2f128_ps(u3, u7, 0x20));
                _mm256_store_ps(o + 4 * 8, _mm256_permute2f128_ps(u0, u4, 0x31));
                _mm256_store_ps(o + 5 * 8, _mm256_permute2f128_ps(u1, u5, 0x31));
                _mm256_store_ps(o + 6 * 8, _mm256_permute2f128_ps(u2, u6, 0x31));
                _mm256_store_ps(o + 7 * 8, _mm256_permute2f128_ps(u3, u7, 0x31));
            }
        }
    }
}

// QB query heads (q[u], fp32 after RoPE) against 8 transposed keys kt (hd x 8): each key's score, the
// contract's lane tree with the keys in the lanes, to out[u][0..7].
template <int QB> inline void scores_8keys(const float* const* q, const float* kt, __m256 scale, float* const* out) {
    constexpr int hd = ATT_BLOCK_HD, C = hd / LANES;
    alignas(32) float s8[QB][8][8];  // lane l's sum plus lane l + 8's, per query head
    for (int l = 0; l < 8; ++l) {
        __m256 a[QB], b[QB];
        for (int u = 0; u < QB; ++u) a[u] = b[u] = _mm256_setzero_ps();
        for (int c = 0; c < C; ++c) {
            const __m256 ka = _mm256_load_ps(kt + (LANES * c + l) * 8), kb = _mm256_load_ps(kt + (LANES * c + l + 8) * 8);
            for (int u = 0; u < QB; ++u) {
                a[u] = _mm256_fmadd_ps(_mm256_broadcast_ss(q[u] + LANES * c + l), ka, a[u]);
                b[u] = _mm256_fmadd_ps(_mm256_broadcast_ss(q[u] + LANES * c + l + 8), kb, b[u]);
            }
        }
        for (int u = 0; u < QB; ++u) _mm256_store_ps(s8[u][l], _mm256_add_ps(a[u], b[u]));
    }
    for (int u = 0; u < QB; ++u) {
        __m256 s4[4];
        for (int l = 0; l < 4; ++l) s4[l] = _mm256_add_ps(_mm256_load_ps(s8[u][l]), _mm256_load_ps(s8[u][l + 4]));
        const __m256 s2a = _mm256_add_ps(s4[0], s4[2]), s2b = _mm256_add_ps(s4[1], s4[3]);
        _mm256_storeu_ps(out[u], _mm256_mul_ps(_mm256_add_ps(s2a, s2b), scale));
    }
}

// The values of QB query heads (p[u]: head u's numerators; tails[u]: its row's tail slots), 16 dims
// a pass: the committed keys from vf (P x hd, widened), then the head's own tail slots from the cache;
// outs[u] gets acc / denom[u]. The 12 accumulators stay in registers through the keys.
template <int QB, class C>
void values_tile(float* const* p, const float* vf, int64_t P, const C* vc, const std::vector<int64_t>* const* tails,
                 const float* denom, float* const* outs) {
    constexpr int hd = ATT_BLOCK_HD;
    for (int64_t d0 = 0; d0 < hd; d0 += 16) {
        __m256 a0[QB], a1[QB];
#pragma GCC unroll 8
        for (int u = 0; u < QB; ++u) a0[u] = a1[u] = _mm256_setzero_ps();
        const float* pu[QB];
#pragma GCC unroll 8
        for (int u = 0; u < QB; ++u) pu[u] = p[u];
        for (int64_t j = 0; j < P; ++j) {
            const __m256 v0 = _mm256_load_ps(vf + j * hd + d0), v1 = _mm256_load_ps(vf + j * hd + d0 + 8);
#pragma GCC unroll 8
            for (int u = 0; u < QB; ++u) {
                const __m256 pj = _mm256_broadcast_ss(pu[u] + j);
                a0[u] = _mm256_fmadd_ps(pj, v0, a0[u]);
                a1[u] = _mm256_fmadd_ps(pj, v1, a1[u]);
                asm("" : "+x"(a0[u]), "+x"(a1[u]));  // each sum in its register (no stack round trip per key)
            }
        }
#pragma GCC unroll 8
        for (int u = 0; u < QB; ++u) {
            __m256 b0 = a0[u], b1 = a1[u];
            const std::vector<int64_t>& tl = *tails[u];
            for (size_t t = 0; t < tl.size(); ++t) {
                const V16 v = v_load(vc + tl[t] * hd + d0);
                const __m256 pj = _mm256_broadcast_ss(pu[u] + P + static_cast<int64_t>(t));
                b0 = _mm256_fmadd_ps(pj, v.lo, b0);
                b1 = _mm256_fmadd_ps(pj, v.hi, b1);
            }
            const __m256 dn = _mm256_set1_ps(denom[u]);
            _mm256_storeu_ps(outs[u] + d0, _mm256_div_ps(b0, dn));
            _mm256_storeu_ps(outs[u] + d0 + 8, _mm256_div_ps(b1, dn));
        }
    }
}

// Rows i0..i0+nr-1 of a tree, KV group g: their rep query heads each (qf: RoPE'd, (nr * rep, hd)).
// Scratch: kt (ATT_BLOCK_KEYS x hd), vf (P x hd), sc (nr * rep rows of sc_stride), of (nr * rep x hd).
template <class C>
void attend_row_block(const float* qf, int64_t nr, int64_t rep, const C* kc, const C* vc, int64_t P,
                      const std::vector<std::vector<int64_t>>& tail, int64_t i0, float scale, float* kt, float* vf,
                      float* sc, int64_t sc_stride, float* of, float* den) {
    constexpr int hd = ATT_BLOCK_HD;
    const int64_t QH = nr * rep;
    const __m256 sv = _mm256_set1_ps(scale);
    // scores of the committed keys, a chunk at a time (the last block of 8 padded: its extra scores
    // land in the row's tail slots or past them, written over below or never read)
    for (int64_t j0 = 0; j0 < P; j0 += ATT_BLOCK_KEYS) {
        const int64_t n = std::min(ATT_BLOCK_KEYS, P - j0);
        transpose_keys(kc, j0, n, kt);
        for (int64_t blk = 0; blk * 8 < n; ++blk)
            tiles<ATT_BLOCK_SCORE_HEADS>(QH, [&](auto qb, int64_t h) {
                constexpr int QB = decltype(qb)::value;
                const float* q[QB];
                float* o[QB];
                for (int u = 0; u < QB; ++u) q[u] = qf + (h + u) * hd, o[u] = sc + (h + u) * sc_stride + j0 + 8 * blk;
                scores_8keys<QB>(q, kt + blk * hd * 8, sv, o);
            });
    }
    // each row's tail (its ancestors and itself): the one-row path's scores
    for (int64_t r = 0; r < nr; ++r) {
        const std::vector<int64_t>& tl = tail[i0 + r];
        key_scores(qf + r * rep * hd, rep, kc, 0, tl, static_cast<int64_t>(tl.size()), hd, scale, nullptr, sc + r * rep * sc_stride + P,
                   sc_stride);
    }
    for (int64_t h = 0; h < QH; ++h) {
        const int64_t L = P + static_cast<int64_t>(tail[i0 + h / rep].size());
        float* sr = sc + h * sc_stride;
        exp_shifted(sr, L, max_of(sr, L));
        den[h] = sum(sr, L);
    }
    // values: the committed ones widened once, then tiles of query heads
    for (int64_t j = 0; j < P; ++j)
        for (int c = 0; c < hd / LANES; ++c) v_store(vf + j * hd + c * LANES, v_load(vc + j * hd + c * LANES));
    tiles<ATT_BLOCK_VALUE_HEADS>(QH, [&](auto qb, int64_t h) {
        constexpr int QB = decltype(qb)::value;
        float* p[QB];
        float* o[QB];
        const std::vector<int64_t>* tl[QB];
        for (int u = 0; u < QB; ++u) p[u] = sc + (h + u) * sc_stride, o[u] = of + (h + u) * hd, tl[u] = &tail[i0 + (h + u) / rep];
        values_tile<QB, C>(p, vf, P, vc, tl, den + h, o);
    });
}

// fp32 scratch of n floats on a 64-byte boundary
struct AlignedFloats {
    float* p;
    explicit AlignedFloats(int64_t n) : p(static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>((n * 4 + 63) / 64 * 64)))) {
        if (!p) throw std::bad_alloc();
    }
    ~AlignedFloats() { std::free(p); }
    AlignedFloats(const AlignedFloats&) = delete;
    AlignedFloats& operator=(const AlignedFloats&) = delete;
};

// The tree's rows in row blocks (attend_row_block), a work item per KV group and block: at most
// ATT_BLOCK_MAX_ROWS rows a block, and at least two items a thread where the rows allow.
template <class T, class C>
void tree_attention_blocks(const T* q, int64_t q_stride, const float* cos, const float* sin, const int64_t* pos, const C* k_cache,
                           const C* v_cache, int64_t cap, int64_t P, int64_t T_, const std::vector<std::vector<int64_t>>& tail,
                           int64_t max_len, int64_t nh, int64_t nkv, float scale, T* out, int64_t out_stride) {
    constexpr int hd = ATT_BLOCK_HD;
    const int64_t half = hd / 2, rep = nh / nkv;
    int64_t nb = (T_ + ATT_BLOCK_MAX_ROWS - 1) / ATT_BLOCK_MAX_ROWS;
    while (nb < T_ && nkv * nb < 2 * static_cast<int64_t>(omp_get_max_threads())) ++nb;
    // (a block's shared slots join its committed keys below: up to max_len - 1 of them, whose last
    // block of 8 pads up to 7 scores past)
    const int64_t sc_stride = (max_len + 8 + 15) / 16 * 16;
    const int64_t max_block = (T_ + nb - 1) / nb, max_qh = max_block * rep;
#pragma omp parallel
    {
        AlignedFloats kt(ATT_BLOCK_KEYS * hd), vf(max_len * hd), sc(max_qh * sc_stride), of(max_qh * hd), qf(max_qh * hd);
        std::vector<float> den(static_cast<size_t>(max_qh));
        std::vector<std::vector<int64_t>> rest(static_cast<size_t>(max_block));
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nkv * nb; ++it) {
            const int64_t g = it / nb, b = it % nb, i0 = b * T_ / nb, nr = (b + 1) * T_ / nb - i0;
            for (int64_t r = 0; r < nr; ++r) {
                const int64_t i = i0 + r;
                rope_queries(q + i * q_stride + g * rep * hd, cos + pos[i] * half, sin + pos[i] * half, rep, hd, qf.p + r * rep * hd);
            }
            // The slots P, P+1, .. that begin every row's tail of this block (a prompt's chunk is a
            // chain: rows i0.. share slots P..P+i0) are the next keys of each row's sequence after
            // slot P-1, so they are scored and weighted as committed keys (in row blocks, not one row
            // at a time): the same keys in the same order, the same bits.
            int64_t shared = 0;
            for (bool more = true; more; shared += more)
                for (int64_t r = 0; r < nr && more; ++r)
                    more = static_cast<int64_t>(tail[i0 + r].size()) > shared && tail[i0 + r][shared] == P + shared;
            for (int64_t r = 0; r < nr; ++r) rest[r].assign(tail[i0 + r].begin() + shared, tail[i0 + r].end());
            attend_row_block<C>(qf.p, nr, rep, k_cache + g * cap * hd, v_cache + g * cap * hd, P + shared, rest, 0, scale, kt.p, vf.p,
                                sc.p, sc_stride, of.p, den.data());
            for (int64_t r = 0; r < nr; ++r)
                for (int64_t e = 0; e < rep * hd; ++e)
                    out[(i0 + r) * out_stride + g * rep * hd + e] = from_f32<T>(of.p[r * rep * hd + e]);
        }
    }
}
#endif

constexpr int64_t ATT_CHUNK = 64;  // committed keys per scores work item: its keys stay in L1 across the tree's rows
// From this many rows (a verify's tree, a prompt's chunk), the AVX2 build's passes below convert a
// scores item's keys to fp32 once for all its rows and score them four keys at a time per head
// (key_scores_v<1, float, 4>, the AVX-512 build's blocks),
// and run the values one 16-lane group a pass (weighted_values_g<R, 1>: two groups' 12 accumulators
// and their operands need 17 ymm registers). Both give the bits of the paths they replace. Measured
// on the AVX2 EPYC (one layer, fp16 cache, one thread's CPU time a row, with weighted_values_g's two
// loops): 64 rows after 768 keys 56-57 -> 36-37 us, after 1500 102-108 -> 68-82; 4 rows after 768
// 50-56 -> 39-42; 2 rows 58-60 -> 46-50; one row (not this path) 66-67 -> 60-61.
constexpr int64_t ATT_MANY_ROWS = 2;
// Committed keys from which a layer's attention runs as three passes (below: one). Measured on the
// AVX2 EPYC, 30 layers of the embedded model's attention, fp32 cache: the passes cost ~4 us a layer
// more below ~200 keys (their barriers), and save 1.6 ms of a 4.4 ms one-row step's attention at 700.
constexpr int64_t ATT_PASSES_FROM = 256;

// A tree's rows over a cache of P committed keys. Short caches: one work item per (row, KV group),
// attend_group. From ATT_PASSES_FROM keys on, three passes over the layer's cache, each split across
// the threads so that every cached key and value is read from memory once for all rows and query
// heads: (1) scores, a work item per KV group and chunk of the committed keys for every row (plus an
// item per group and row for its ancestors); (2) per row and head, the maximum, the exponentials and
// their sum; (3) the weighted values, a work item per KV group and 16-lane group of the head dim for
// every row. Every output element is the contract's one sequence either way (a score is one key's
// lane tree wherever its chunk starts; a lane sums the keys in order whichever lanes share its item),
// so both give attend_group's bits. One item per (row, KV group) alone, a one-token step of the
// embedded model (3 KV groups, 2 threads) either left a thread idle or (one item per query head) read
// each group's cache once per head: 30 layers' attention after 700 cached tokens took 4.4 ms.
template <class T, class C>
void tree_attention_impl(const T* q, int64_t q_stride, const T* k, int64_t k_stride, const T* v, int64_t v_stride,
                         const float* cos, const float* sin, const int64_t* pos, C* k_cache, C* v_cache, int64_t cap,
                         int64_t P, int64_t T_, const int64_t* parents, int64_t nh, int64_t nkv, int64_t hd, float scale,
                         T* out, int64_t out_stride) {
    const int64_t half = hd / 2, rep = nh / nkv, lane_groups = (hd + LANES - 1) / LANES;
    for (int64_t i = 0; i < T_; ++i)  // the new rows' keys and values at slots P+i
        store_key_value(k + i * k_stride, v + i * v_stride, cos + pos[i] * half, sin + pos[i] * half, k_cache, v_cache, cap,
                        P + i, nkv, hd);
    // Each row's ancestor slots (root first), from the parent links.
    std::vector<std::vector<int64_t>> tail(T_);
    for (int64_t i = 0; i < T_; ++i) {
        if (parents[i] >= i) throw std::invalid_argument("tree_attention: parents[i] must be < i");
        for (int64_t a = i; a >= 0; a = parents[a]) tail[i].push_back(P + a);
        std::reverse(tail[i].begin(), tail[i].end());
    }
    int64_t max_len = 0;
    for (auto& t : tail) max_len = std::max<int64_t>(max_len, P + static_cast<int64_t>(t.size()));
#if defined(DART_V16_AVX2)
    if (T_ >= ATT_BLOCK_FROM_ROWS && hd == ATT_BLOCK_HD && nh % nkv == 0)
        return tree_attention_blocks<T, C>(q, q_stride, cos, sin, pos, k_cache, v_cache, cap, P, T_, tail, max_len, nh, nkv, scale, out,
                                           out_stride);
#endif
    if (P < ATT_PASSES_FROM) {
#pragma omp parallel
        {
            std::vector<float> qf(static_cast<size_t>(rep * hd)), kf(hd), vf(hd), acc(static_cast<size_t>(rep * hd));
            std::vector<float> scores(static_cast<size_t>(rep * max_len));
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < T_ * nkv; ++it) {
                const int64_t i = it / nkv, g = it % nkv;
                rope_queries(q + i * q_stride + g * rep * hd, cos + pos[i] * half, sin + pos[i] * half, rep, hd, qf.data());
                attend_group(qf.data(), rep, k_cache + g * cap * hd, v_cache + g * cap * hd, P, tail[i],
                             P + static_cast<int64_t>(tail[i].size()), hd, scale, kf.data(), vf.data(), scores.data(), max_len,
                             acc.data(), out + i * out_stride + g * rep * hd);
            }
        }
        return;
    }
    // scores: (T, nh, max_len), then the softmax numerators. Not zero-filled: every element read is
    // written first (zeroing them was ~3% of a 6-row call).
    const std::unique_ptr<float[]> scores(new float[T_ * nh * max_len]), denom(new float[T_ * nh]);
    const std::vector<int64_t> none;
    const int64_t chunks = (P + ATT_CHUNK - 1) / ATT_CHUNK, prefix_items = nkv * chunks;
    // value items of a 64-byte line of each value row (one lane group of an fp32 cache, two of a 16-bit
    // one): two threads never fetch the same line (Zen 2's L3 is filled by L2 evictions, so the second
    // thread would read it from memory again)
    const int64_t item_groups = std::max<int64_t>(1, 64 / (LANES * static_cast<int64_t>(sizeof(C))));
    const int64_t value_items = (lane_groups + item_groups - 1) / item_groups;
#if defined(DART_V16_AVX2)
    const bool many = T_ >= ATT_MANY_ROWS && hd % LANES == 0;
#else  // AVX-512 scores four keys a pass for every head already (ATT_KEYS) and keeps 4 groups in its 32 registers
    const bool many = false;
#endif
#pragma omp parallel
    {
        std::vector<float> kf(hd), vf(hd), acc(static_cast<size_t>(rep * hd));
        std::vector<float> kb(many ? static_cast<size_t>(ATT_CHUNK * hd) : 0);  // a scores item's keys in fp32
        // Every row's queries of one KV group after RoPE, (T, rep, hd): each thread computes those of the
        // group its item needs when the group changes (cheaper than a barrier and a shared table).
        std::vector<float> qf(static_cast<size_t>(T_ * rep * hd));
        int64_t roped = -1;
        auto queries = [&](int64_t i, int64_t g) {
            if (g != roped) {
                for (int64_t r = 0; r < T_; ++r)
                    rope_queries(q + r * q_stride + g * rep * hd, cos + pos[r] * half, sin + pos[r] * half, rep, hd, qf.data() + r * rep * hd);
                roped = g;
            }
            return qf.data() + i * rep * hd;
        };
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < prefix_items + T_ * nkv; ++it) {
            if (it < prefix_items) {  // committed keys j0..j0+n-1 of group g, every row
                const int64_t g = it / chunks, j0 = it % chunks * ATT_CHUNK, n = std::min(ATT_CHUNK, P - j0);
#ifdef DART_V16
                if (many) {
                    const C* kc = k_cache + (g * cap + j0) * hd;
                    for (int64_t e = 0; e < n * hd; e += LANES) v_store(kb.data() + e, v_load(kc + e));
                    for (int64_t i = 0; i < T_; ++i)
                        for (int64_t r = 0; r < rep; ++r)
                            key_scores_v<1, float, 4, false>(queries(i, g) + r * hd, kb.data(), n, none, n, hd, scale,
                                                              scores.get() + (i * nh + g * rep + r) * max_len + j0, max_len);
                    continue;
                }
#endif
                for (int64_t i = 0; i < T_; ++i)
                    key_scores(queries(i, g), rep, k_cache + (g * cap + j0) * hd, n, none, n, hd, scale,
                               kf.data(), scores.get() + (i * nh + g * rep) * max_len + j0, max_len);
            } else {  // row i's ancestors and itself, group g (rows of one group in a row: queries() ropes once)
                const int64_t g = (it - prefix_items) / T_, i = (it - prefix_items) % T_;
                key_scores(queries(i, g), rep, k_cache + g * cap * hd, 0, tail[i],
                           static_cast<int64_t>(tail[i].size()), hd, scale, kf.data(),
                           scores.get() + (i * nh + g * rep) * max_len + P, max_len);
            }
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < T_ * nh; ++it) {
            const int64_t L = P + static_cast<int64_t>(tail[it / nh].size());
            float* sr = scores.get() + it * max_len;
            exp_shifted(sr, L, max_of(sr, L));
            denom[it] = sum(sr, L);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nkv * value_items; ++it) {
            const int64_t g = it / value_items, c = it % value_items * item_groups, c1 = std::min(c + item_groups, lane_groups);
            const int64_t d0 = c * LANES, d1 = std::min(c1 * LANES, hd);
            for (int64_t i = 0; i < T_; ++i) {
                const int64_t h = i * nh + g * rep, L = P + static_cast<int64_t>(tail[i].size());
                weighted_values(scores.get() + h * max_len, max_len, rep, v_cache + g * cap * hd, P, tail[i], L, hd, vf.data(),
                                acc.data(), c, c1, many);
                for (int64_t r = 0; r < rep; ++r)
                    for (int64_t d = d0; d < d1; ++d)
                        out[i * out_stride + (g * rep + r) * hd + d] = from_f32<T>(acc[r * hd + d] / denom[h + r]);
            }
        }
    }
}

// ------------------------------------------------------------------------------------- rows of separate sequences
// B independent sequences, one new row each (continuous-batching generation, Transformer.decode_rows):
// row b's committed length P_b = committed[b] is also its position; its cache is the slab at
// k_cache + b * seq_stride, (nkv, cap, hd). Row b is exactly a one-token tree_attention call on its own
// slab (attend_group over the prefix and the one-slot tail {P_b}: its bits), so a sequence
// decoded beside others gets the bits plain decoding gives it alone, and no padding is computed.
template <class T, class C>
void rows_attention_impl(const T* q, int64_t q_stride, const T* k, int64_t k_stride, const T* v, int64_t v_stride,
                         const float* cos, const float* sin, const int64_t* committed, C* k_cache, C* v_cache,
                         int64_t seq_stride, int64_t cap, int64_t B, int64_t nh, int64_t nkv, int64_t hd, float scale, T* out,
                         int64_t out_stride) {
    const int64_t half = hd / 2, rep = nh / nkv;
    std::vector<std::vector<int64_t>> tail(B);
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t P = committed[b];
        store_key_value(k + b * k_stride, v + b * v_stride, cos + P * half, sin + P * half, k_cache + b * seq_stride,
                        v_cache + b * seq_stride, cap, P, nkv, hd);
        tail[b] = {P};
        max_len = std::max(max_len, P + 1);
    }
#pragma omp parallel
    {
        std::vector<float> qf(static_cast<size_t>(rep * hd)), kf(hd), vf(hd), acc(static_cast<size_t>(rep * hd));
        std::vector<float> scores(static_cast<size_t>(rep * max_len));
#pragma omp for schedule(dynamic, 4)
        for (int64_t it = 0; it < B * nkv; ++it) {
            const int64_t b = it / nkv, g = it % nkv, P = committed[b];
            rope_queries(q + b * q_stride + g * rep * hd, cos + P * half, sin + P * half, rep, hd, qf.data());
            const C* kc = k_cache + b * seq_stride + g * cap * hd;
            const C* vc = v_cache + b * seq_stride + g * cap * hd;
            attend_group(qf.data(), rep, kc, vc, P, tail[b], P + 1, hd, scale, kf.data(), vf.data(), scores.data(), max_len,
                         acc.data(), out + b * out_stride + g * rep * hd);
        }
    }
}

#define DART_ATTENTION(T, C) \
    template void tree_attention_impl<T, C>(const T*, int64_t, const T*, int64_t, const T*, int64_t, const float*, const float*, \
        const int64_t*, C*, C*, int64_t, int64_t, int64_t, const int64_t*, int64_t, int64_t, int64_t, float, T*, int64_t); \
    template void rows_attention_impl<T, C>(const T*, int64_t, const T*, int64_t, const T*, int64_t, const float*, const float*, \
        const int64_t*, C*, C*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, T*, int64_t);
DART_FOR_EACH_CACHE_DTYPE(DART_ATTENTION)

}  // namespace dart
