#include "context.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace ngram {

void Continuations::add(token_t t) {
    ++total;
    last = t;
    for (auto& tc : counts)
        if (tc.first == t) {
            ++tc.second;
            return;
        }
    counts.emplace_back(t, 1);
}

// The slot of a hash: ContextKeyHash's low bits follow the tokens' low bits (FNV's multiplies carry
// upwards only), so they are mixed first (MurmurHash3's finaliser), or similar keys probe long runs.
static inline uint64_t mixed(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    return h ^ (h >> 33);
}

const Continuations* ContextIndex::Table::find(const ContextKey& key, uint64_t hash) const {
    if (slots_.empty()) return nullptr;
    const size_t mask = slots_.size() - 1;
    for (size_t i = hash & mask;; i = (i + 1) & mask) {
        const Slot& s = slots_[i];
        if (s.entry < 0) return nullptr;
        if (s.hash == hash && keys_[s.entry] == key) return &values_[s.entry];
    }
}

Continuations& ContextIndex::Table::at(const ContextKey& key, uint64_t hash) {
    if (2 * (keys_.size() + 1) > slots_.size()) grow();  // at most half full: short probes
    const size_t mask = slots_.size() - 1;
    size_t i = hash & mask;
    for (;; i = (i + 1) & mask) {
        const Slot& s = slots_[i];
        if (s.entry < 0) break;
        if (s.hash == hash && keys_[s.entry] == key) return values_[s.entry];
    }
    slots_[i] = Slot{hash, static_cast<int32_t>(keys_.size())};
    keys_.push_back(key);
    values_.emplace_back();
    return values_.back();
}

void ContextIndex::Table::grow() {
    std::vector<Slot> old(slots_.empty() ? 64 : 2 * slots_.size(), Slot{0, -1});
    old.swap(slots_);
    const size_t mask = slots_.size() - 1;
    for (const Slot& s : old) {
        if (s.entry < 0) continue;
        size_t i = s.hash & mask;
        while (slots_[i].entry >= 0) i = (i + 1) & mask;
        slots_[i] = s;
    }
}

ContextIndex::ContextIndex(int max_order) : max_order_(max_order) {
    if (max_order < 1 || max_order > kMaxContextOrder)
        throw std::invalid_argument("context max_order must be in 1.." + std::to_string(kMaxContextOrder));
    maps_.resize(static_cast<size_t>(max_order));
}

void ContextIndex::extend(const token_t* tokens, size_t n) {
    seq_.reserve(seq_.size() + n);
    for (size_t i = 0; i < n; ++i) {
        if (tokens[i] < 0) throw std::invalid_argument("token id " + std::to_string(tokens[i]) + " is negative");
        // the n-grams ending at the current last token are now followed by tokens[i]
        const size_t end = seq_.size();
        for (int len = 1; len <= max_order_ && static_cast<size_t>(len) <= end; ++len) {
            ContextKey key;
            key.len = static_cast<uint8_t>(len);
            std::copy(seq_.end() - len, seq_.end(), key.tokens.begin());
            maps_[len - 1].at(key, mixed(ContextKeyHash{}(key))).add(tokens[i]);
        }
        seq_.push_back(tokens[i]);
    }
}

// `out` keeps its storage from call to call (the pruner asks once a parent): cleared, not replaced.
static void clear(Continuations& c) {
    c.counts.clear();
    c.total = 0;
    c.last = -1;
}

int ContextIndex::lookup(const token_t* virt, size_t n_virt, int min_len, Continuations& out) const {
    clear(out);
    const size_t total = seq_.size() + n_virt;
    auto at = [&](size_t i) { return i < seq_.size() ? seq_[i] : virt[i - seq_.size()]; };  // virtual sequence
    const int longest = static_cast<int>(std::min<size_t>(static_cast<size_t>(max_order_), total));
    for (int len = longest; len >= std::max(1, min_len); --len) {
        ContextKey key;
        key.len = static_cast<uint8_t>(len);
        for (int j = 0; j < len; ++j) key.tokens[j] = at(total - len + j);
        if (const Continuations* found = maps_[len - 1].find(key, mixed(ContextKeyHash{}(key)))) {
            out.counts.assign(found->counts.begin(), found->counts.end());
            out.total = found->total;
            out.last = found->last;
        }
        // an occurrence ending at the last indexed token is followed by the first virtual token (the root);
        // with no virtual tokens that occurrence is the query suffix itself
        if (n_virt > 0 && seq_.size() >= static_cast<size_t>(len)) {
            bool same = true;
            for (int j = 0; j < len && same; ++j) same = seq_[seq_.size() - len + j] == key.tokens[j];
            if (same) out.add(virt[0]);
        }
        if (out.total > 0) return len;
    }
    clear(out);
    return 0;
}

}  // namespace ngram
