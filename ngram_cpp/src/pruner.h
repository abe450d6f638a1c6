// DART's n-gram guided tree pruner: a beam search over the draft head's per-position top-k lists,
// scored with the draft probabilities and an n-gram model, keeping the best nodes as a draft tree.
//
// Score of a node at level l (0-based; depth l+1), added to its parent's score:
//     w_l * ( decay^l * ln(p + eps)  +  ngram_weight * ln(q + eps) )        w_l = (l+1)^level_exponent
// where p is the draft probability (softmaxed over the top-k by the caller) and q the n-gram
// probability of the token after the last order-1 tokens of (context, root, path); the n-gram term is
// skipped at level 0 unless ngram_on_first_level, and everywhere if !use_ngram. An increment is
// clamped to <= 0 (ln(1 + eps) is positive when p = q = 1), so scores never increase along a path.
// Each level extends the beam_width best sequences (those ending in EOS are ranked last and dropped
// from the beam, so they are never extended); the tree is the max_nodes best of all expanded nodes
// across levels, ranked by (score desc, depth asc, expansion order asc): a tie goes to the ancestor,
// so the kept set is closed under taking parents; with a score floor, the cut ends earlier at the
// first node past min_nodes whose score is below min_score (still a prefix, still closed). The search runs at most max_nodes levels with a
// beam of at most max_nodes: beyond that it cannot change the tree (pruner.cpp says why).
//
// The context n-gram (optional, `context` index given and context_weight > 0): for each parent, the
// longest suffix (length m >= context_min_match) of indexed tokens + root + path that occurred
// earlier in the conversation gives a continuation distribution c(t) (counts / total). The draft
// probability p and the n-gram probability q of a candidate are both mixed with it,
//     p' = (1 - lambda) p + lambda c(t)    q' = (1 - lambda) q + lambda c(t)
//     lambda = context_weight * m / context_max_order,
// so a longer match is trusted more, and a repeat of the conversation is not vetoed by a corpus trie
// that never saw it (names, numbers). Continuations missing from the head's top-k join the parent's
// candidates with p = 0 (at most context_max_candidates, most frequent first, ties: first seen), and
// for context_extend levels past the head's last row a branch keeps growing along the context alone
// while its match is at least context_extend_min_match long (prompt lookup inside the tree). Such
// nodes are marked in PrunedTree::sources (1: head candidate the context supports, 2: context only).
//
// The fitted ranking (PruneParams::acceptance non-empty) reorders the search's nodes for the final
// cut by a calibrated model of acceptance instead of the score: P(node accepted) (its whole path is
// the target's continuation), a logistic regression per level on the features acceptance_features()
// lists (the node's score and increment, the head's probability and rank, the row's confidence, the
// trie's probability, the context match, the parent's fitted value), fitted by exact replay
// (scripts/fit_acceptance.py). A node's fitted value is min(ln P, its parent's): a node is accepted
// only if its parent is, which also keeps the kept set closed under taking parents. The beam search
// still runs on the score (it decides which nodes exist; the fit decides which are kept), and the
// tree's scores are the fitted ln P(accepted), so a tree of the N best nodes maximises the model's
// expected accepted length at N nodes. In that mode the trie's probability is a feature at every
// level (whatever ngram_on_first_level says for the score).
// With row_costs as well, the tree size adapts per step: of the sizes n <= max_nodes (and >=
// min_nodes), the one with the most expected tokens per unit of cost, (1 + sum of the n kept nodes'
// P(accepted)) / row_costs[n] (the cost of a step verifying n + 1 rows, drafting included).
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "context.h"
#include "ngram.h"

namespace ngram {

struct PruneParams {
    int top_k = 25;
    int beam_width = 20;
    int max_nodes = 60;  // drafted nodes kept, root excluded
    double level_exponent = -0.7;
    double logit_decay = 0.9;
    double ngram_weight = 0.5;
    bool use_ngram = true;
    bool ngram_on_first_level = false;
    double eps = 1e-10;
    double context_weight = 0.0;  // lambda at a full-length match; 0: context n-gram off
    int context_min_match = 1;
    int context_extend = 0;  // levels past the head's rows drafted from the context alone
    int context_extend_min_match = 2;
    int context_max_candidates = 4;  // context-only candidates per parent
    // Score floor (a tree that adapts its size): past the first min_nodes of the ranking, a node is
    // kept only if its score is >= min_score. -inf: every tree has max_nodes nodes (if found).
    double min_score = -std::numeric_limits<double>::infinity();
    int min_nodes = 0;
    // The fitted ranking: [levels * kAcceptanceFeatures] logistic weights, row l for level l (levels
    // past the last row use the last); empty: the final cut ranks by the score.
    std::vector<double> acceptance;
    // Adaptive tree size (with `acceptance` only): row_costs[r - 1] is the cost of a step that
    // verifies r rows (root included), any unit; a tree keeps at most row_costs.size() - 1 nodes.
    std::vector<double> row_costs;
};

// The fitted ranking's features of one node (ngram_cpp/reference.py mirrors them; the fit reads them
// from there). score / inc: its score and its increment over the parent's; head: the candidate is in
// the head's top-k row (rank its column there); head_row: the level has a head row (row_top its
// largest probability); q: the trie's probability (0: unseen or no trie); match: the context's match
// length (0: none), c the context's continuation share of the token; parent_fit: the parent's fitted
// ln P (0 at level 0).
constexpr int kAcceptanceFeatures = 14;
void acceptance_features(double score, double inc, bool head, double p, int64_t rank, bool head_row, double row_top, double q,
                         int match, int max_order, double c, double parent_fit, double* x);

// Node provenance in PrunedTree::sources.
enum : uint8_t { kFromHead = 0, kHeadAndContext = 1, kFromContext = 2 };

// Arrays for the verifier; N = kept nodes + 1 (index 0 is the root). Nodes are in depth order and,
// within a depth, in the order of the final ranking: score descending, then expansion order (the
// order in which the beam search created them). Parents therefore always precede their children.
struct PrunedTree {
    std::vector<int64_t> tokens;     // [N]
    std::vector<int64_t> parents;    // [N], root -1
    std::vector<int64_t> positions;  // [N], depth: root 0
    std::vector<float> scores;       // [N], cumulative beam score, root 0
    std::vector<uint8_t> sources;    // [N], kFromHead / kHeadAndContext / kFromContext; root kFromHead
    std::vector<uint8_t> mask;       // [N, N], row i: i and its ancestors (prune only)
    std::vector<int64_t> retrieve;   // [n_leaves, max_depth + 1], root-to-leaf node indices, -1 padded (prune only)
    int64_t n_leaves = 0;
    int64_t width = 0;  // max_depth + 1
};

// tokens/probs: [d, k] row-major (row j = candidates for depth j+1, target-vocabulary ids; probs
// already softmaxed over the row by the caller, as upstream). Only the first min(k, top_k) columns
// are used. context: the committed tokens before the root, NOT including it (only the last order-1
// matter). model may be null; so may index (the context n-gram over every committed token before the
// root). Throws std::invalid_argument on bad shapes, ids or probabilities.
PrunedTree prune(const int64_t* tokens, const float* probs, int64_t d, int64_t k, int64_t root, const int64_t* context,
                 int64_t n_context, const NGramModel* model, const PruneParams& params, int64_t eos_id,
                 const ContextIndex* index = nullptr);

// The same search and the same nodes as prune, without the verifier's layouts (mask, retrieve stay
// empty): for a caller that builds its own (DART's drafter, once a step).
PrunedTree prune_nodes(const int64_t* tokens, const float* probs, int64_t d, int64_t k, int64_t root, const int64_t* context,
                       int64_t n_context, const NGramModel* model, const PruneParams& params, int64_t eos_id,
                       const ContextIndex* index = nullptr);

}  // namespace ngram
