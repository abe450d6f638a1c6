// The context n-gram: a per-request index over the tokens of one conversation (the prompt and the
// answer so far), so the pruner can propose what the text already repeats (prompt lookup, in-tree).
//
// For every n in 1..max_order it maps each n-gram that occurred to the tokens that followed it and
// how often. `extend` appends committed tokens and updates the maps in O(max_order) per token.
// `lookup` answers, for a virtual sequence (indexed tokens + root + a draft path), the longest
// suffix of length >= min_len that occurred before with a known continuation, and that
// continuation's counts. The root is the target's newest token: it is committed but not yet
// indexed, so an occurrence ending at the last indexed token counts the root as its continuation.
// Occurrences inside the draft path itself are not counted: the path is a hypothesis, not text.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "ngram.h"

namespace ngram {

constexpr int kMaxContextOrder = 8;

struct ContextKey {
    std::array<token_t, kMaxContextOrder> tokens{};
    uint8_t len = 0;
    bool operator==(const ContextKey& o) const { return len == o.len && tokens == o.tokens; }
};

struct ContextKeyHash {
    size_t operator()(const ContextKey& k) const {
        uint64_t h = 1469598103934665603ull ^ k.len;
        for (int i = 0; i < k.len; ++i) h = (h ^ static_cast<uint32_t>(k.tokens[i])) * 1099511628211ull;
        return static_cast<size_t>(h ^ (h >> 29));
    }
};

// Continuations of one n-gram: (token, count) in first-seen order, and the most recent one.
struct Continuations {
    std::vector<std::pair<token_t, uint32_t>> counts;
    uint32_t total = 0;
    token_t last = -1;
    void add(token_t t);
};

class ContextIndex {
  public:
    explicit ContextIndex(int max_order);

    void extend(const token_t* tokens, size_t n);
    size_t size() const { return seq_.size(); }
    int max_order() const { return max_order_; }
    const std::vector<token_t>& tokens() const { return seq_; }

    // virt: the last `n_virt` tokens of the virtual sequence that follow the indexed ones (root, then a
    // draft path), oldest first. Looks for the longest suffix of (indexed tokens + virt), of length
    // min_len..max_order, that occurred earlier with a continuation. Returns its length (0: none) and
    // fills `out` with the continuation counts (the root counted for an occurrence ending at the last
    // indexed token, which the maps do not hold yet).
    int lookup(const token_t* virt, size_t n_virt, int min_len, Continuations& out) const;

  private:
    // One order's n-grams and their continuations: an open-addressing table (a power-of-two number
    // of slots, linear probing, each slot the key's hash and its entry, -1 empty) over entries kept
    // in insertion order. The pruner looks up a few suffixes for every parent of every level, and a
    // node-based map's chains cost it a pointer chase and a division a probe.
    class Table {
      public:
        const Continuations* find(const ContextKey& key, uint64_t hash) const;
        Continuations& at(const ContextKey& key, uint64_t hash);  // inserted empty where absent

      private:
        struct Slot {
            uint64_t hash;
            int32_t entry;  // -1: empty
        };
        void grow();
        std::vector<Slot> slots_;
        std::vector<ContextKey> keys_;
        std::vector<Continuations> values_;
    };
    int max_order_;
    std::vector<token_t> seq_;
    std::vector<Table> maps_;  // [n - 1]
};

}  // namespace ngram
