#include "pruner.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

// No OpenMP: a level expands at most beam_width (20) candidates of ~1 us each; on the 2-core
// machines this runs on, thread start-up costs more than the work it would split.

namespace ngram {

namespace {

struct Node {
    int32_t token;
    int32_t parent;  // index into the node pool, -1 = child of the root
    int32_t depth;   // 1-based
    double score;
};

// Ranking of the final cut: higher score first; on ties the shallower (an ancestor) and then the
// earlier-expanded node first, so the kept set is always closed under taking parents.
struct Better {
    const std::vector<Node>* pool;
    bool operator()(int32_t a, int32_t b) const {
        const Node &x = (*pool)[a], &y = (*pool)[b];
        if (x.score != y.score) return x.score > y.score;
        if (x.depth != y.depth) return x.depth < y.depth;
        return a < b;
    }
};

void check_inputs(const int64_t* tokens, const float* probs, int64_t d, int64_t k, int64_t root, const NGramModel* model,
                  const PruneParams& p) {
    if (d < 1 || k < 1) throw std::invalid_argument("tokens/probs must be [d, k] with d >= 1 and k >= 1");
    if (p.top_k < 1 || p.beam_width < 1 || p.max_nodes < 0)
        throw std::invalid_argument("top_k and beam_width must be >= 1, max_nodes >= 0");
    if (!(p.eps > 0) || !std::isfinite(p.level_exponent) || !std::isfinite(p.logit_decay) || !std::isfinite(p.ngram_weight))
        throw std::invalid_argument("score weights must be finite and eps > 0");
    int64_t vocab = model ? model->vocab_size() : INT32_MAX;
    if (root < 0 || root >= vocab) throw std::invalid_argument("root token " + std::to_string(root) + " out of range");
    for (int64_t j = 0; j < d; ++j) {
        for (int64_t i = 0; i < k; ++i) {
            int64_t t = tokens[j * k + i];
            float q = probs[j * k + i];
            if (t < 0 || t >= vocab)
                throw std::invalid_argument("token id " + std::to_string(t) + " at [" + std::to_string(j) + ", " + std::to_string(i) +
                                            "] out of range [0, " + std::to_string(vocab) + ")");
            if (!std::isfinite(q) || q < 0.0f || q > 1.0f)
                throw std::invalid_argument("draft probability at [" + std::to_string(j) + ", " + std::to_string(i) + "] is not in [0, 1]");
            for (int64_t h = 0; h < i; ++h)
                if (tokens[j * k + h] == t) throw std::invalid_argument("token " + std::to_string(t) + " appears twice in row " + std::to_string(j));
        }
    }
}

}  // namespace

PrunedTree prune(const int64_t* tokens, const float* probs, int64_t d, int64_t k, int64_t root, const int64_t* context,
                 int64_t n_context, const NGramModel* model, const PruneParams& p, int64_t eos_id) {
    check_inputs(tokens, probs, d, k, root, model, p);
    const int64_t kk = std::min<int64_t>(k, p.top_k);
    const uint32_t order = model ? model->order() : 1;
    const size_t ctx_len = order > 1 ? order - 1 : 0;

    std::vector<Node> pool;
    pool.reserve(static_cast<size_t>(kk) * (1 + static_cast<size_t>(p.beam_width) * static_cast<size_t>(d)));
    std::vector<int32_t> beam{-1}, next;
    std::vector<token_t> ctx(ctx_len), cand(kk);
    std::vector<double> q(kk, 1.0);

    for (int64_t level = 0; level < d && !beam.empty(); ++level) {
        const double w = std::pow(static_cast<double>(level + 1), p.level_exponent);
        const double decay = std::pow(p.logit_decay, static_cast<double>(level));
        const bool ngram = model && p.use_ngram && ctx_len > 0 && (level > 0 || p.ngram_on_first_level);
        for (int64_t i = 0; i < kk; ++i) cand[i] = static_cast<token_t>(tokens[level * k + i]);
        next.clear();
        for (int32_t parent : beam) {
            if (ngram) {
                // last ctx_len tokens of (context, root, path to parent), oldest first
                size_t have = 0;
                for (int32_t n = parent; n >= 0 && have < ctx_len; n = pool[n].parent) ctx[ctx_len - 1 - have++] = pool[n].token;
                if (have < ctx_len) ctx[ctx_len - 1 - have++] = static_cast<token_t>(root);
                for (int64_t c = n_context - 1; c >= 0 && have < ctx_len; --c) ctx[ctx_len - 1 - have++] = static_cast<token_t>(context[c]);
                model->probs(ctx.data() + (ctx_len - have), have, cand.data(), kk, q.data());
            }
            const double base = parent >= 0 ? pool[parent].score : 0.0;
            const int32_t depth = parent >= 0 ? pool[parent].depth + 1 : 1;
            for (int64_t i = 0; i < kk; ++i) {
                double term = decay * std::log(static_cast<double>(probs[level * k + i]) + p.eps);
                if (ngram) term += p.ngram_weight * std::log(q[i] + p.eps);
                // ln(1 + eps) > 0: clamp so a child never outscores its parent
                double inc = std::min(0.0, w * term);
                pool.push_back(Node{cand[i], parent, depth, base + inc});
                next.push_back(static_cast<int32_t>(pool.size() - 1));
            }
        }
        // beam cut: non-EOS before EOS, then by score, then expansion order
        auto beam_order = [&](int32_t a, int32_t b) {
            bool ea = pool[a].token == eos_id, eb = pool[b].token == eos_id;
            if (ea != eb) return eb;
            if (pool[a].score != pool[b].score) return pool[a].score > pool[b].score;
            return a < b;
        };
        size_t keep = std::min<size_t>(next.size(), static_cast<size_t>(p.beam_width));
        std::partial_sort(next.begin(), next.begin() + keep, next.end(), beam_order);
        next.resize(keep);
        // an EOS-ending sequence is never extended
        while (!next.empty() && pool[next.back()].token == eos_id) next.pop_back();
        beam.swap(next);
    }

    // Global cut: the max_nodes best nodes of every level.
    std::vector<int32_t> order_idx(pool.size());
    for (size_t i = 0; i < pool.size(); ++i) order_idx[i] = static_cast<int32_t>(i);
    Better better{&pool};
    size_t want = std::min<size_t>(pool.size(), static_cast<size_t>(p.max_nodes));
    std::partial_sort(order_idx.begin(), order_idx.begin() + want, order_idx.end(), better);
    std::vector<int32_t> kept;
    std::vector<int32_t> new_index(pool.size(), -1);
    kept.reserve(want);
    for (size_t i = 0; i < want; ++i) {
        int32_t n = order_idx[i];
        if (pool[n].parent >= 0 && new_index[pool[n].parent] < 0) continue;  // unreachable given the ranking; kept for safety
        new_index[n] = 0;
        kept.push_back(n);
    }
    // depth order; within a depth, best first
    std::stable_sort(kept.begin(), kept.end(), [&](int32_t a, int32_t b) { return pool[a].depth < pool[b].depth; });

    PrunedTree t;
    const size_t N = kept.size() + 1;
    t.tokens.assign(N, root);
    t.parents.assign(N, -1);
    t.positions.assign(N, 0);
    t.scores.assign(N, 0.0f);
    t.mask.assign(N * N, 0);
    t.mask[0] = 1;
    std::vector<uint8_t> has_child(N, 0);
    int64_t max_depth = 0;
    for (size_t i = 0; i < kept.size(); ++i) {
        const Node& n = pool[kept[i]];
        const size_t idx = i + 1;
        new_index[kept[i]] = static_cast<int32_t>(idx);
        const int64_t par = n.parent >= 0 ? new_index[n.parent] : 0;
        t.tokens[idx] = n.token;
        t.parents[idx] = par;
        t.positions[idx] = n.depth;
        t.scores[idx] = static_cast<float>(n.score);
        std::copy(t.mask.begin() + par * N, t.mask.begin() + par * N + N, t.mask.begin() + idx * N);
        t.mask[idx * N + idx] = 1;
        has_child[par] = 1;
        max_depth = std::max<int64_t>(max_depth, n.depth);
    }
    // Leaves in lexicographic order of their token paths (a prefix before its extensions).
    std::vector<std::vector<int64_t>> paths;
    for (size_t i = 0; i < N; ++i) {
        if (has_child[i]) continue;
        std::vector<int64_t> path;
        for (int64_t n = static_cast<int64_t>(i); n > 0; n = t.parents[n]) path.push_back(n);
        std::reverse(path.begin(), path.end());
        paths.push_back(std::move(path));
    }
    std::sort(paths.begin(), paths.end(), [&](const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
        return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end(),
                                            [&](int64_t x, int64_t y) { return t.tokens[x] < t.tokens[y]; });
    });
    t.n_leaves = static_cast<int64_t>(paths.size());
    t.width = max_depth + 1;
    t.retrieve.assign(static_cast<size_t>(t.n_leaves * t.width), -1);
    for (size_t r = 0; r < paths.size(); ++r) {
        t.retrieve[r * t.width] = 0;
        for (size_t j = 0; j < paths[r].size(); ++j) t.retrieve[r * t.width + 1 + j] = paths[r][j];
    }
    return t;
}

}  // namespace ngram
