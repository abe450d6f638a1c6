#include "pruner.h"

#include <algorithm>
#include <array>
#include <utility>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>

// No OpenMP: a level expands at most beam_width (20) parents of a few microseconds each. Measured on
// the 2-core development machine (d=8, k=25, w=20, the embedded trie, frequent-token candidates,
// before the per-level memo below): 0.2 ms single-threaded against 1.2-2.2 ms with a `parallel for`
// over the parents on 2 threads; fork/join and a busy second core cost more than the work they split.

namespace ngram {

namespace {

struct Node {
    int32_t token;
    int32_t parent;  // index into the node pool, -1 = child of the root
    int32_t depth;   // 1-based
    double score;    // the hand-weighted score: the beam's order
    double fit;      // the fitted ranking's ln P(accepted) (0 without one): the final cut's order
    uint8_t source;  // kFromHead / kHeadAndContext / kFromContext
};

// ln(sigmoid(z)) without overflow: the fitted ranking's ln P, always < 0.
double log_sigmoid(double z) { return z >= 0.0 ? -std::log1p(std::exp(-z)) : z - std::log1p(std::exp(z)); }

// Floor of the probabilities whose logarithm is a feature (a softmaxed top-k can hold exact zeros).
constexpr double kFeatureFloor = 1e-6;

// N-gram count ratios of one level's candidates after context suffixes, memoised per level: every
// parent at a level scores the same candidates, and parents share suffixes (all parents ending in
// token t share the one-token context), so each distinct suffix is looked up once.
class NgramRows {
  public:
    NgramRows(const NGramModel& model, const token_t* cand, size_t k) : model_(model), k_(k), perm_(k), sorted_(k), tmp_(k) {
        for (size_t i = 0; i < k; ++i) perm_[i] = i;
        std::sort(perm_.begin(), perm_.end(), [cand](size_t a, size_t b) { return cand[a] < cand[b]; });
        for (size_t i = 0; i < k; ++i) sorted_[i] = cand[perm_[i]];
    }

    // [k] ratios (NGramModel::kUnseen where the candidate never followed) after `suffix[0..len)`.
    const double* ratios(const token_t* suffix, size_t len) {
        for (const Entry& e : entries_)
            if (e.len == len && std::equal(suffix, suffix + len, e.key.begin())) return data_.data() + e.offset;
        Entry e{len, {}, data_.size()};
        std::copy(suffix, suffix + len, e.key.begin());
        entries_.push_back(e);
        data_.resize(data_.size() + k_);
        double* row = data_.data() + e.offset;
        int64_t node = model_.find_context(suffix, len, len);
        if (node < 0) {
            std::fill(row, row + k_, NGramModel::kUnseen);
        } else {
            model_.child_ratios(len, node, sorted_.data(), k_, tmp_.data());
            for (size_t i = 0; i < k_; ++i) row[perm_[i]] = tmp_[i];
        }
        return row;
    }

  private:
    struct Entry {
        size_t len;
        std::array<token_t, kMaxOrder> key;
        size_t offset;
    };
    const NGramModel& model_;
    size_t k_;
    std::vector<size_t> perm_;     // candidate indices in ascending token order
    std::vector<token_t> sorted_;  // the candidates in that order
    std::vector<double> tmp_;
    std::vector<Entry> entries_;
    std::vector<double> data_;
};

// Ranking of the final cut: higher score (the fitted ln P where there is a fitted ranking) first;
// on ties the shallower (an ancestor) and then the earlier-expanded node first, so the kept set is
// always closed under taking parents (a node never ranks above its parent on either key).
struct Better {
    const std::vector<Node>* pool;
    bool fitted;
    double key(const Node& n) const { return fitted ? n.fit : n.score; }
    bool operator()(int32_t a, int32_t b) const {
        const Node &x = (*pool)[a], &y = (*pool)[b];
        if (key(x) != key(y)) return key(x) > key(y);
        if (x.depth != y.depth) return x.depth < y.depth;
        return a < b;
    }
};

// Pool size above which the inputs are refused rather than allocated (upstream's largest search
// expands 25 * (1 + 20 * 7) = 3,525 nodes).
constexpr int64_t kMaxExpandedNodes = int64_t{1} << 24;
// Without a model that knows the vocabulary, ids only need to fit the trie's int32 tokens.
constexpr int64_t kTokenIdLimit = int64_t{INT32_MAX} + 1;

void check_token(int64_t t, int64_t vocab, const char* where, int64_t row = -1, int64_t col = -1) {
    if (t >= 0 && t < vocab) return;
    std::string at = row >= 0 ? " at [" + std::to_string(row) + ", " + std::to_string(col) + "]" : std::string(where);
    throw std::invalid_argument("token id " + std::to_string(t) + at + " out of range [0, " + std::to_string(vocab) + ")");
}

// Candidates a parent can expand into at most, and the levels searched.
int64_t max_children(int64_t k, const PruneParams& p, bool context) {
    return std::min<int64_t>(k, p.top_k) + (context ? p.context_max_candidates : 0);
}

void check_inputs(const int64_t* tokens, const float* probs, int64_t d, int64_t k, int64_t root, const int64_t* context,
                  int64_t n_context, const NGramModel* model, const PruneParams& p, bool use_context) {
    if (d < 1 || k < 1) throw std::invalid_argument("tokens/probs must be [d, k] with d >= 1 and k >= 1");
    if (p.top_k < 1 || p.beam_width < 1 || p.max_nodes < 0)
        throw std::invalid_argument("top_k and beam_width must be >= 1, max_nodes >= 0");
    if (!(p.eps > 0) || !std::isfinite(p.eps) || !std::isfinite(p.level_exponent) || !std::isfinite(p.logit_decay) ||
        !std::isfinite(p.ngram_weight))
        throw std::invalid_argument("score weights must be finite and eps > 0");
    if (!(p.context_weight >= 0.0 && p.context_weight <= 1.0))
        throw std::invalid_argument("context_weight must be in [0, 1]");
    if (std::isnan(p.min_score) || p.min_nodes < 0) throw std::invalid_argument("min_score must not be NaN and min_nodes must be >= 0");
    if (p.acceptance.size() % kAcceptanceFeatures != 0)
        throw std::invalid_argument("acceptance must hold levels * " + std::to_string(kAcceptanceFeatures) + " weights");
    for (double w : p.acceptance)
        if (!std::isfinite(w)) throw std::invalid_argument("acceptance weights must be finite");
    if (!p.row_costs.empty() && p.acceptance.empty()) throw std::invalid_argument("row_costs (adaptive size) needs the acceptance model");
    for (double c : p.row_costs)
        if (!(c > 0.0) || !std::isfinite(c)) throw std::invalid_argument("row_costs must be positive and finite");
    if (p.context_min_match < 1 || p.context_extend < 0 || p.context_extend_min_match < 1 || p.context_max_candidates < 0)
        throw std::invalid_argument("context_min_match and context_extend_min_match must be >= 1, context_extend and context_max_candidates >= 0");
    const int64_t levels = d + (use_context ? p.context_extend : 0);
    const int64_t kk = max_children(k, p, use_context);
    if (static_cast<double>(kk) * (1.0 + static_cast<double>(p.beam_width) * static_cast<double>(levels - 1)) > kMaxExpandedNodes)
        throw std::invalid_argument("d * beam_width * top_k is too large (more than " + std::to_string(kMaxExpandedNodes) +
                                    " expanded nodes)");
    const int64_t vocab = model && model->vocab_known() ? model->vocab_size() : kTokenIdLimit;
    check_token(root, vocab, " (root)");
    for (int64_t c = 0; c < n_context; ++c) check_token(context[c], vocab, " in the context");
    for (int64_t j = 0; j < d; ++j) {
        for (int64_t i = 0; i < k; ++i) {
            int64_t t = tokens[j * k + i];
            float q = probs[j * k + i];
            check_token(t, vocab, "", j, i);
            if (!std::isfinite(q) || q < 0.0f || q > 1.0f)
                throw std::invalid_argument("draft probability at [" + std::to_string(j) + ", " + std::to_string(i) + "] is not in [0, 1]");
            for (int64_t h = 0; h < i; ++h)
                if (tokens[j * k + h] == t) throw std::invalid_argument("token " + std::to_string(t) + " appears twice in row " + std::to_string(j));
        }
    }
}

// The last ctx_len tokens of (context, root, path to parent), oldest first, into ctx[ctx_len - have ..);
// returns `have` (fewer than ctx_len when the whole sequence is shorter).
size_t ngram_context(const std::vector<Node>& pool, int32_t parent, int64_t root, const int64_t* context, int64_t n_context,
                     token_t* ctx, size_t ctx_len) {
    size_t have = 0;
    for (int32_t n = parent; n >= 0 && have < ctx_len; n = pool[n].parent) ctx[ctx_len - 1 - have++] = pool[n].token;
    if (have < ctx_len) ctx[ctx_len - 1 - have++] = static_cast<token_t>(root);
    for (int64_t c = n_context - 1; c >= 0 && have < ctx_len; --c) ctx[ctx_len - 1 - have++] = static_cast<token_t>(context[c]);
    return have;
}

// The n-gram probability of one token after ctx[ctx_len - have, ctx_len): the upstream rule (the
// longest suffix it was seen after; 0 if none), as NgramRows gives it for a level's shared candidates.
double trie_prob(const NGramModel& model, const token_t* ctx_end, size_t have, token_t token) {
    for (size_t len = have; len >= 1; --len) {
        int64_t node = model.find_context(ctx_end - len, len, len);
        if (node < 0) continue;
        double r = model.child_ratio(len, node, token);
        if (r != NGramModel::kUnseen) return r;
    }
    return 0.0;
}

}  // namespace

// The features given the logarithms that do not depend on the parent (ln_p = ln max(p, floor) of a
// head candidate, ln_rank = ln(1 + rank), ln_row_top = ln max(row_top, floor) of a level with a head
// row), which the search takes once a level instead of once a node: acceptance_features computes
// them by the same expressions, so both give the same bits.
static inline void features_from_logs(double score, double inc, bool head, double ln_p, int64_t rank, double ln_rank, bool head_row,
                                      double ln_row_top, double q, int match, int max_order, double c, double parent_fit, double* x) {
    x[0] = 1.0;
    x[1] = score;
    x[2] = inc;
    x[3] = head ? ln_p : 0.0;
    x[4] = head ? 1.0 : 0.0;
    x[5] = head && rank == 0 ? 1.0 : 0.0;
    x[6] = head ? ln_rank : 0.0;
    x[7] = head_row ? ln_row_top : 0.0;
    x[8] = q > 0.0 ? std::log(q) : 0.0;
    x[9] = q > 0.0 ? 1.0 : 0.0;
    x[10] = match > 0 ? static_cast<double>(match) / static_cast<double>(max_order) : 0.0;
    x[11] = c > 0.0 ? std::log(c) : 0.0;
    x[12] = c > 0.0 ? 1.0 : 0.0;
    x[13] = parent_fit;
}

static inline double ln_floored(double v) { return std::log(std::max(v, kFeatureFloor)); }
static inline double ln_rank_term(int64_t rank) { return std::log1p(static_cast<double>(rank)); }

void acceptance_features(double score, double inc, bool head, double p, int64_t rank, bool head_row, double row_top, double q,
                         int match, int max_order, double c, double parent_fit, double* x) {
    features_from_logs(score, inc, head, head ? ln_floored(p) : 0.0, rank, head ? ln_rank_term(rank) : 0.0, head_row,
                       head_row ? ln_floored(row_top) : 0.0, q, match, max_order, c, parent_fit, x);
}

PrunedTree prune_nodes(const int64_t* tokens, const float* probs, int64_t d, int64_t k, int64_t root, const int64_t* context,
                       int64_t n_context, const NGramModel* model, const PruneParams& p, int64_t eos_id, const ContextIndex* index) {
    const bool use_context = index != nullptr && p.context_weight > 0.0;
    const bool fitted = !p.acceptance.empty();
    const int64_t fitted_levels = static_cast<int64_t>(p.acceptance.size()) / kAcceptanceFeatures;
    check_inputs(tokens, probs, d, k, root, context, n_context, model, p, use_context);
    const int64_t kk = std::min<int64_t>(k, p.top_k);
    // The search stops where it can no longer change the tree. A kept node at depth l+1 needs its l
    // ancestors kept too, so no level past max_nodes contributes; and a kept node's parent ranks
    // among the max_nodes best of its level (every node ranked before it is kept as well, ranks
    // being one order), so a wider beam only expands nodes that are cut. Same trees as the full
    // search (the reference, uncapped, checks it); at the CPU default of 5 nodes it is ~4x less work.
    const int64_t levels = std::min<int64_t>(d + (use_context ? p.context_extend : 0), p.max_nodes);
    // Under a fitted ranking the beam cap is a choice, not an equivalence (the fit may keep a node whose
    // parent ranked past max_nodes by score): the same cap, since the wider beam measured no better
    // (scripts/fit_acceptance.py --evaluate) and cost 0.15-0.2 ms a step more at 3-5 nodes.
    const size_t beam_width = static_cast<size_t>(std::min<int64_t>(p.beam_width, std::max(p.max_nodes, 1)));
    const uint32_t order = model ? model->order() : 1;
    const size_t ctx_len = order > 1 ? order - 1 : 0;

    std::vector<Node> pool;
    pool.reserve(static_cast<size_t>(max_children(k, p, use_context)) *
                 (1 + beam_width * static_cast<size_t>(std::max<int64_t>(levels - 1, 0))));
    std::vector<int32_t> beam{-1}, next;
    std::vector<token_t> ctx(ctx_len), cand(kk), virt;
    std::vector<double> draft_p(kk), ngram_q(kk), cont_p(kk);
    // what a level's head candidates share across its parents, taken once a level: ln(p + eps), the
    // draft term's logarithm where the parent has no context match (lambda = 0, c = 0, so the mixed
    // (1 - lambda) p + lambda c + eps is p + eps to the bit), and the fitted ranking's ln max(p, floor);
    // ln(1 + rank) once a search
    std::vector<double> ln_p_eps(kk), ln_p_floor(kk), ln_rank(kk);
    // the draft term's logarithm of a head candidate the parent's context match does not continue
    // (c = 0), by match length: lambda depends on the length alone, so parents of one match length
    // share it; taken when first needed (NaN: not yet), by the same expression as per node
    const int match_lengths = use_context ? index->max_order() + 1 : 1;
    std::vector<double> ln_p_match(static_cast<size_t>(match_lengths * kk));
    for (int64_t i = 0; i < kk; ++i) ln_rank[i] = ln_rank_term(i);
    std::vector<uint8_t> done(kk);
    std::vector<std::pair<token_t, uint32_t>> extra;
    Continuations cont;

    for (int64_t level = 0; level < levels && !beam.empty(); ++level) {
        const double w = std::pow(static_cast<double>(level + 1), p.level_exponent);
        const double decay = std::pow(p.logit_decay, static_cast<double>(level));
        const bool head_row = level < d;
        // the trie's probability: a term of the score past level 0 (and at level 0 if ngram_on_first_level),
        // and a feature of the fitted ranking at every level
        const bool ngram_term = model && p.use_ngram && ctx_len > 0 && (level > 0 || p.ngram_on_first_level);
        const bool ngram = ngram_term || (fitted && model && p.use_ngram && ctx_len > 0);
        // the fitted ranking's weights for this level, and the head row's largest probability
        const double* wl = fitted ? p.acceptance.data() + std::min(level, fitted_levels - 1) * kAcceptanceFeatures : nullptr;
        double row_top = 0.0;
        if (head_row) {
            for (int64_t i = 0; i < kk; ++i) {
                cand[i] = static_cast<token_t>(tokens[level * k + i]);
                draft_p[i] = static_cast<double>(probs[level * k + i]);
                row_top = std::max(row_top, draft_p[i]);
                ln_p_eps[i] = std::log(draft_p[i] + p.eps);
                if (fitted) ln_p_floor[i] = ln_floored(draft_p[i]);
            }
        }
        const double ln_row_top = head_row && fitted ? ln_floored(row_top) : 0.0;
        std::fill(ln_p_match.begin(), ln_p_match.end(), std::numeric_limits<double>::quiet_NaN());
        std::optional<NgramRows> rows;
        if (ngram && head_row) rows.emplace(*model, cand.data(), static_cast<size_t>(kk));
        next.clear();
        for (int32_t parent : beam) {
            size_t have = 0;
            if (ngram) have = ngram_context(pool, parent, root, context, n_context, ctx.data(), ctx_len);
            const token_t* ctx_end = ctx.data() + ctx_len;
            if (ngram && head_row) {
                // upstream rule per candidate: the longest suffix of the context it was seen after
                std::fill(ngram_q.begin(), ngram_q.end(), 0.0);  // unseen after every suffix: 0
                std::fill(done.begin(), done.end(), 0);
                for (size_t len = have; len >= 1; --len) {
                    const double* r = rows->ratios(ctx_end - len, len);
                    for (int64_t i = 0; i < kk; ++i) {
                        if (done[i] || r[i] == NGramModel::kUnseen) continue;
                        done[i] = 1;
                        ngram_q[i] = r[i];
                    }
                }
            }
            // the context n-gram after indexed tokens + root + path
            int match = 0;
            double lambda = 0.0;
            if (use_context) {
                virt.clear();
                for (int32_t n = parent; n >= 0; n = pool[n].parent) virt.push_back(pool[n].token);
                virt.push_back(static_cast<token_t>(root));
                std::reverse(virt.begin(), virt.end());
                match = index->lookup(virt.data(), virt.size(), p.context_min_match, cont);
                if (match > 0) lambda = p.context_weight * static_cast<double>(match) / static_cast<double>(index->max_order());
            }
            const double base = parent >= 0 ? pool[parent].score : 0.0;
            const double parent_fit = parent >= 0 ? pool[parent].fit : 0.0;
            const int32_t depth = parent >= 0 ? pool[parent].depth + 1 : 1;
            // rank: the column in the head's row, -1 for a context-only candidate
            auto push = [&](token_t token, double prob, int64_t rank, double q, double c, uint8_t source) {
                // both the draft and the n-gram probability are mixed with the context's continuation c
                // (the level's table where there is none: a head candidate, lambda = 0)
                double ln_draft;
                if (rank >= 0 && lambda == 0.0) {
                    ln_draft = ln_p_eps[rank];
                } else if (rank >= 0 && c == 0.0) {
                    double& memo = ln_p_match[static_cast<size_t>(match * kk + rank)];
                    if (std::isnan(memo)) memo = std::log((1.0 - lambda) * prob + lambda * c + p.eps);
                    ln_draft = memo;
                } else {
                    ln_draft = std::log((1.0 - lambda) * prob + lambda * c + p.eps);
                }
                double term = decay * ln_draft;
                if (ngram_term) term += p.ngram_weight * std::log((1.0 - lambda) * q + lambda * c + p.eps);
                // ln(1 + eps) > 0: clamp so a child never outscores its parent
                const double inc = std::min(0.0, w * term);
                double fit = 0.0;
                if (fitted) {
                    double x[kAcceptanceFeatures];
                    const bool head = rank >= 0;
                    features_from_logs(base + inc, inc, head, head ? ln_p_floor[rank] : 0.0, rank, head ? ln_rank[rank] : 0.0, head_row,
                                       ln_row_top, ngram ? q : 0.0, match, use_context ? index->max_order() : 1, c, parent_fit, x);
                    double z = 0.0;
                    for (int f = 0; f < kAcceptanceFeatures; ++f) z += wl[f] * x[f];
                    // a node is accepted only if its parent is: never more likely than the parent
                    fit = std::min(log_sigmoid(z), parent >= 0 ? parent_fit : 0.0);
                }
                pool.push_back(Node{token, parent, depth, base + inc, fit, source});
                next.push_back(static_cast<int32_t>(pool.size() - 1));
            };
            if (head_row) {
                std::fill(cont_p.begin(), cont_p.end(), 0.0);
                for (const auto& tc : cont.counts)
                    for (int64_t i = 0; i < kk; ++i)
                        if (match > 0 && cand[i] == tc.first) cont_p[i] = static_cast<double>(tc.second) / cont.total;
                for (int64_t i = 0; i < kk; ++i)
                    push(cand[i], draft_p[i], i, ngram ? ngram_q[i] : 0.0, cont_p[i], cont_p[i] > 0.0 ? kHeadAndContext : kFromHead);
            }
            if (match > 0 && (head_row || match >= p.context_extend_min_match)) {
                // continuations the head did not propose: most frequent first, ties in first-seen order
                extra.clear();
                for (const auto& tc : cont.counts) {
                    bool in_row = false;
                    for (int64_t i = 0; head_row && i < kk && !in_row; ++i) in_row = cand[i] == tc.first;
                    if (!in_row) extra.push_back(tc);
                }
                std::stable_sort(extra.begin(), extra.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
                if (extra.size() > static_cast<size_t>(p.context_max_candidates)) extra.resize(static_cast<size_t>(p.context_max_candidates));
                for (const auto& tc : extra) {
                    const double c = static_cast<double>(tc.second) / cont.total;
                    push(tc.first, 0.0, -1, ngram ? trie_prob(*model, ctx_end, have, tc.first) : 0.0, c, kFromContext);
                }
            }
        }
        // Beam cut: non-EOS before EOS (as upstream), then by score, then expansion order; the EOS
        // entries that still made the cut are dropped, so an EOS-ending sequence is never extended.
        auto beam_order = [&](int32_t a, int32_t b) {
            bool ea = pool[a].token == eos_id, eb = pool[b].token == eos_id;
            if (ea != eb) return eb;
            if (pool[a].score != pool[b].score) return pool[a].score > pool[b].score;
            return a < b;
        };
        size_t keep = std::min<size_t>(next.size(), beam_width);
        std::partial_sort(next.begin(), next.begin() + keep, next.end(), beam_order);
        next.resize(keep);
        while (!next.empty() && pool[next.back()].token == eos_id) next.pop_back();
        beam.swap(next);
    }

    // Global cut: the max_nodes best nodes of every level.
    std::vector<int32_t> order_idx(pool.size());
    for (size_t i = 0; i < pool.size(); ++i) order_idx[i] = static_cast<int32_t>(i);
    Better better{&pool, fitted};
    size_t want = std::min<size_t>(pool.size(), static_cast<size_t>(p.max_nodes));
    // the `want` first of a strict total order (Better breaks every tie), in order: the same nodes
    // and order as a partial sort, in linear time for the selection (the pool holds thousands of
    // nodes at 60 kept)
    if (want < order_idx.size()) std::nth_element(order_idx.begin(), order_idx.begin() + want, order_idx.end(), better);
    std::sort(order_idx.begin(), order_idx.begin() + want, better);
    for (size_t i = std::min(want, static_cast<size_t>(p.min_nodes)); i < want; ++i) {
        if (better.key(pool[order_idx[i]]) < p.min_score) {  // the score floor: ranks are by score, so the rest is below too
            want = i;
            break;
        }
    }
    if (fitted && !p.row_costs.empty()) {
        // adaptive size: the prefix of the ranking with the most expected tokens (the root's one plus
        // each kept node's P(accepted) = exp(score)) per unit of step cost
        const size_t limit = std::min(want, p.row_costs.size() - 1);
        size_t n = std::min(limit, static_cast<size_t>(p.min_nodes)), best_n = n;
        double expected = 1.0;
        for (size_t i = 0; i < n; ++i) expected += std::exp(pool[order_idx[i]].fit);
        double best = expected / p.row_costs[n];
        for (++n; n <= limit; ++n) {
            expected += std::exp(pool[order_idx[n - 1]].fit);
            const double v = expected / p.row_costs[n];
            if (v > best) best = v, best_n = n;
        }
        want = best_n;
    }
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
    t.sources.assign(N, kFromHead);
    for (size_t i = 0; i < kept.size(); ++i) {
        const Node& n = pool[kept[i]];
        const size_t idx = i + 1;
        new_index[kept[i]] = static_cast<int32_t>(idx);
        t.tokens[idx] = n.token;
        t.parents[idx] = n.parent >= 0 ? new_index[n.parent] : 0;
        t.positions[idx] = n.depth;
        t.scores[idx] = static_cast<float>(better.key(n));
        t.sources[idx] = n.source;
    }
    return t;
}

PrunedTree prune(const int64_t* tokens, const float* probs, int64_t d, int64_t k, int64_t root, const int64_t* context,
                 int64_t n_context, const NGramModel* model, const PruneParams& p, int64_t eos_id, const ContextIndex* index) {
    PrunedTree t = prune_nodes(tokens, probs, d, k, root, context, n_context, model, p, eos_id, index);
    const size_t N = t.tokens.size();
    t.mask.assign(N * N, 0);
    t.mask[0] = 1;
    std::vector<uint8_t> has_child(N, 0);
    int64_t max_depth = 0;
    for (size_t idx = 1; idx < N; ++idx) {
        const int64_t par = t.parents[idx];
        std::copy(t.mask.begin() + par * N, t.mask.begin() + par * N + N, t.mask.begin() + idx * N);
        t.mask[idx * N + idx] = 1;
        has_child[par] = 1;
        max_depth = std::max<int64_t>(max_depth, t.positions[idx]);
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
