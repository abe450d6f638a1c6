// Whole forwards in one call each: the target's decoder layers (layers_forward_impl) and a DART
// head's draft forward (draft_forward_impl), on the kernels of the other translation units.
#include "kernels.h"

namespace dart {

// ------------------------------------------------------------------------------------- the decoder stack
// All decoder layers of one decode/verify forward in one call: the same kernels, in the same order, on
// the same buffers as the per-op path of dart_core/model.py (so the same bits), without ~100 us of
// Python and tensor allocation per layer: ~3 ms of a 9-15 ms forward of the 30-layer embedded target.
//
// plan (n_layers, PLAN_FIELDS) int64, one row a layer (dart_core/kernels/stack.py LayerStack builds it):
// weight format, data pointer, row bytes of q|k|v, o, gate|up and down; the q|k|v bias (0: none); the
// two norms' weights. x (T, H) is the residual stream in, and out: the last layer's residual before
// its MLP output `pending` (T, H) is added (the final norm adds it). Captured residuals (the input of
// each layer in `capture`, after its attention norm's add) go to captured (T, n_capture * H).
// seq_stride 0: the T rows are one tree after P committed entries of one cache (tree_attention);
// seq_stride > 0: they are T separate sequences, row b's cache the slab at b * seq_stride within each
// layer and pos[b] its committed length and position (rows_attention).
// (PlanField: kernels.h)
template <class T, class C>
void layers_forward_impl(const int64_t* plan, int64_t L, int64_t T_, int64_t H, int64_t I, int64_t nh, int64_t nkv,
                         int64_t hd, float eps, const float* cos, const float* sin, const int64_t* pos,
                         const int64_t* parents, int64_t P, C* k_cache, C* v_cache, int64_t layer_stride, int64_t seq_stride,
                         int64_t cap, T* x, T* pending, const int64_t* capture, int64_t n_capture, T* captured) {
    const int64_t q_out = nh * hd, kv_out = nkv * hd, qkv_n = q_out + 2 * kv_out;
    std::vector<T> h(T_ * H), qkv(T_ * qkv_n), o(T_ * q_out), gu(T_ * 2 * I), act(T_ * I);
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));  // as Python's 1.0 / math.sqrt(hd), rounded once
    bool have_pending = false;
    for (int64_t l = 0; l < L; ++l) {
        const int64_t* p = plan + l * PLAN_FIELDS;
        add_rmsnorm_impl<T>(x, have_pending ? pending : nullptr, ptr<const T>(p[ATT_NORM]), T_, H, eps, x, h.data());
        for (int64_t c = 0; c < n_capture; ++c)
            if (capture[c] == l)
                for (int64_t t = 0; t < T_; ++t) std::memcpy(captured + t * n_capture * H + c * H, x + t * H, H * sizeof(T));
        linear_fmt<T>(p[QKV_FMT], h.data(), H, T_, H, ptr<const uint8_t>(p[QKV_W]), p[QKV_RB], qkv_n, ptr<const T>(p[QKV_B]), qkv.data(), qkv_n);
        if (seq_stride == 0)
            tree_attention_impl<T, C>(qkv.data(), qkv_n, qkv.data() + q_out, qkv_n, qkv.data() + q_out + kv_out, qkv_n, cos, sin,
                                   pos, k_cache + l * layer_stride, v_cache + l * layer_stride, cap, P, T_, parents, nh, nkv, hd,
                                   scale, o.data(), q_out);
        else
            rows_attention_impl<T, C>(qkv.data(), qkv_n, qkv.data() + q_out, qkv_n, qkv.data() + q_out + kv_out, qkv_n, cos, sin,
                                   pos, k_cache + l * layer_stride, v_cache + l * layer_stride, seq_stride, cap, T_, nh, nkv,
                                   hd, scale, o.data(), q_out);
        linear_fmt<T>(p[O_FMT], o.data(), q_out, T_, q_out, ptr<const uint8_t>(p[O_W]), p[O_RB], H, nullptr, pending, H);
        add_rmsnorm_impl<T>(x, pending, ptr<const T>(p[FFN_NORM]), T_, H, eps, x, h.data());
        linear_fmt<T>(p[W13_FMT], h.data(), H, T_, H, ptr<const uint8_t>(p[W13_W]), p[W13_RB], 2 * I, nullptr, gu.data(), 2 * I);
        silu_mul_impl<T>(gu.data(), 2 * I, T_, I, act.data());
        linear_fmt<T>(p[W2_FMT], act.data(), I, T_, I, ptr<const uint8_t>(p[W2_W]), p[W2_RB], H, nullptr, pending, H);
        have_pending = true;
    }
}

// ------------------------------------------------------------------------------------- a DART head's draft forward
// The DART head's whole draft forward in one call (dart_core/drafters/head.py KernelHead.draft): the
// ops of KernelHead.inputs, .layer and .logits, in their order and on the same kernels, without the
// ~15 Python kernel calls and tensor allocations a step around them. Drafts need no exactness (the
// verify decides); the tests compare it with those methods.
//
// plan (DRAFT_FIELDS) int64: format, data pointer and row bytes of fc, q|k|v, o, gate|up, down and
// the LM head, then the input, hidden, post-attention and final norms' weights and the mask vector
// (2H). aux (S, 3H) and emb (S, H): the S committed tokens' target states and embeddings, followed
// by D mask rows. The T = S + D rows' keys and values go to slots P.. of the head's one cache layer
// (nkv, cap, hd), each row attending to the prefix and the rows before it; the last D + 1 rows'
// logits go to logits (D + 1, Vd).
// (DraftField: kernels.h)
template <class T>
void draft_forward_impl(const int64_t* pl, int64_t S, int64_t D, int64_t H, int64_t I, int64_t Vd, int64_t nh, int64_t nkv,
                        int64_t hd, float eps, bool double_norm, const T* aux, const T* emb, const float* cos, const float* sin,
                        int64_t P, T* k_cache, T* v_cache, int64_t cap, T* logits) {
    const int64_t T_ = S + D, keep = D + 1, q_out = nh * hd, kv_out = nkv * hd, qkv_n = q_out + 2 * kv_out;
    auto W = [&](int64_t f) { return ptr<const uint8_t>(pl[f]); };
    auto V = [&](int64_t f) { return ptr<const T>(pl[f]); };
    std::vector<T> g(S * H), e(S * H), nrm(S * H), scratch(T_ * H), u(T_ * 2 * H), res(T_ * H), qkv(T_ * qkv_n), att(T_ * q_out);
    std::vector<T> o(keep * H), h(keep * H), x(keep * H), gu(keep * 2 * I), act(keep * I), dn(keep * H), y(keep * H), z(keep * H);
    // inputs: g = fc(aux); u = [norm(emb) | norm(g)] with the residual g, then the mask rows, which
    // bypass both norms (u = mask, residual = its first H elements)
    linear_fmt<T>(pl[FC_FMT], aux, 3 * H, S, 3 * H, W(FC_W), pl[FC_RB], H, nullptr, g.data(), H);
    add_rmsnorm_impl<T>(emb, nullptr, V(INPUT_NORM), S, H, eps, scratch.data(), e.data());
    add_rmsnorm_impl<T>(g.data(), nullptr, V(HIDDEN_NORM), S, H, eps, scratch.data(), nrm.data());
    const T* mask = V(MASK_REP);
    for (int64_t t = 0; t < T_; ++t) {
        T* ut = u.data() + t * 2 * H;
        if (t < S) {
            std::memcpy(ut, e.data() + t * H, H * sizeof(T));
            std::memcpy(ut + H, nrm.data() + t * H, H * sizeof(T));
            std::memcpy(res.data() + t * H, g.data() + t * H, H * sizeof(T));
        } else {
            std::memcpy(ut, mask, 2 * H * sizeof(T));
            std::memcpy(res.data() + t * H, mask, H * sizeof(T));
        }
    }
    // the layer: causal attention after the cached prefix, then o and the MLP on the last `keep` rows
    linear_fmt<T>(pl[DQKV_FMT], u.data(), 2 * H, T_, 2 * H, W(DQKV_W), pl[DQKV_RB], qkv_n, nullptr, qkv.data(), qkv_n);
    std::vector<int64_t> pos(T_), parents(T_);
    for (int64_t t = 0; t < T_; ++t) pos[t] = P + t, parents[t] = t - 1;
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
    tree_attention_impl<T, T>(qkv.data(), qkv_n, qkv.data() + q_out, qkv_n, qkv.data() + q_out + kv_out, qkv_n, cos, sin, pos.data(),
                           k_cache, v_cache, cap, P, T_, parents.data(), nh, nkv, hd, scale, att.data(), q_out);
    linear_fmt<T>(pl[DO_FMT], att.data() + (T_ - keep) * q_out, q_out, keep, q_out, W(DO_W), pl[DO_RB], H, nullptr, o.data(), H);
    add_rmsnorm_impl<T>(res.data() + (T_ - keep) * H, o.data(), V(POST_NORM), keep, H, eps, h.data(), x.data());  // h = res + o
    linear_fmt<T>(pl[DGU_FMT], x.data(), H, keep, H, W(DGU_W), pl[DGU_RB], 2 * I, nullptr, gu.data(), 2 * I);
    silu_mul_impl<T>(gu.data(), 2 * I, keep, I, act.data());
    linear_fmt<T>(pl[DDOWN_FMT], act.data(), I, keep, I, W(DDOWN_W), pl[DDOWN_RB], H, nullptr, dn.data(), H);
    // logits: the final norm of h + down (twice for heads with double_norm), the LM head
    add_rmsnorm_impl<T>(h.data(), dn.data(), V(FINAL_NORM), keep, H, eps, y.data(), z.data());
    if (double_norm) {
        add_rmsnorm_impl<T>(z.data(), nullptr, V(FINAL_NORM), keep, H, eps, y.data(), x.data());
        z.swap(x);
    }
    linear_fmt<T>(pl[LM_FMT], z.data(), H, keep, H, W(LM_W), pl[LM_RB], Vd, nullptr, logits, Vd);
}

#define DART_LAYERS_FORWARD(T, C) \
    template void layers_forward_impl<T, C>(const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, \
        const float*, const float*, const int64_t*, const int64_t*, int64_t, C*, C*, int64_t, int64_t, int64_t, T*, T*, const int64_t*, \
        int64_t, T*);
DART_FOR_EACH_CACHE_DTYPE(DART_LAYERS_FORWARD)
#define DART_DRAFT_FORWARD(T) \
    template void draft_forward_impl<T>(const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, \
        bool, const T*, const T*, const float*, const float*, int64_t, T*, T*, int64_t, T*);
DART_FOR_EACH_DTYPE(DART_DRAFT_FORWARD)

}  // namespace dart
