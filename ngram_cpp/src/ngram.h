// N-gram count trie stored level by level, for DART's tree pruner.
//
// Every prefix of every n-gram (n <= order) is a node. Level l (1-based) holds the nodes of depth l,
// grouped by parent in the parent level's order and sorted by token within a parent, so the children
// of node i at level l are the contiguous range [first_child[i], first_child[i+1]) of level l+1 and can
// be binary-searched. count(node) = occurrences of that token sequence in the corpus (upstream's freq).
//
// The same arrays back both an owned in-memory model and a read-only memory-mapped file (our compact
// format), so loading a trie of any size is one mmap plus a header check.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ngram {

using token_t = int32_t;
using count_t = uint32_t;
using index_t = uint64_t;

constexpr int kMaxOrder = 8;

// Compact format (".ngram"), little-endian:
//     offset 0    CompactHeader (160 bytes)
//     then, for each level l = 1..order, each array starting on an 8-byte boundary (zero padding):
//         tokens       int32[level_size[l]]
//         counts       uint32[level_size[l]]
//         first_child  uint64[level_size[l] + 1]     (absent for the last level)
// The file ends right after the last array (no trailing bytes). Loading maps the file read-only and
// checks the header, that every array lies inside the file and the first/last child offsets; a
// lookup clamps every child range it reads, so a damaged file can give wrong answers but never read
// out of bounds. NGramModel::validate() checks every array (sortedness, ranges, counts).
struct CompactHeader {
    char magic[8];          // "DARTNGRM"
    uint32_t version;       // kCompactVersion
    uint32_t order;         // n-gram order, 1..kMaxOrder
    uint32_t vocab_size;    // tokens are in [0, vocab_size)
    uint32_t flags;         // kFlag* bits
    uint64_t total;         // root count: number of tokens in the corpus
    uint64_t level_size[kMaxOrder];  // nodes per level (levels 1..order)
    char fingerprint[64];   // tokenizer fingerprint (hex string, NUL padded)
};
static_assert(sizeof(CompactHeader) == 160, "header layout");

constexpr char kCompactMagic[8] = {'D', 'A', 'R', 'T', 'N', 'G', 'R', 'M'};
constexpr uint32_t kCompactVersion = 1;
// vocab_size is only max token id + 1 (the trie came from an upstream .trie, which does not record
// the tokenizer's vocabulary size), so ids at or beyond it are not necessarily invalid.
constexpr uint32_t kFlagVocabIsLowerBound = 1u << 0;
constexpr uint32_t kKnownFlags = kFlagVocabIsLowerBound;

// One level of the trie: views into owned vectors or into a mapped file.
struct Level {
    const token_t* tokens = nullptr;       // [size]
    const count_t* counts = nullptr;       // [size]
    const index_t* first_child = nullptr;  // [size + 1], into the next level; null for the last level
    uint64_t size = 0;
};

struct Storage;  // owns the memory behind the levels (vectors or a mapping)

class NGramModel {
  public:
    // Builds from level arrays (takes ownership).
    NGramModel(uint32_t order, uint32_t vocab_size, uint64_t total, std::vector<std::vector<token_t>> tokens,
               std::vector<std::vector<count_t>> counts, std::vector<std::vector<index_t>> first_child,
               std::string fingerprint);
    ~NGramModel();
    NGramModel(const NGramModel&) = delete;
    NGramModel& operator=(const NGramModel&) = delete;

    static std::unique_ptr<NGramModel> load_compact(const std::string& path);   // mmap, header checked
    static std::unique_ptr<NGramModel> load_upstream(const std::string& path);  // fvliang/DART .trie
    void save_compact(const std::string& path) const;
    void save_upstream(const std::string& path) const;
    // Full structural check of every array (touches every page): sortedness, ranges, counts.
    void validate() const;

    uint32_t order() const { return order_; }
    uint32_t vocab_size() const { return vocab_size_; }
    // True when vocab_size is the tokenizer's (built by us); false for a trie read from an upstream
    // .trie, whose vocab_size is only max token id + 1.
    bool vocab_known() const { return vocab_known_; }
    // Stamps the tokenizer's vocabulary size and fingerprint (e.g. on an upstream trie before saving
    // it in the compact format); vocab_size must cover every token id in the trie.
    void set_metadata(uint32_t vocab_size, const std::string& fingerprint);
    uint64_t total() const { return total_; }
    uint64_t num_nodes() const;  // root included, as upstream counts
    const std::string& fingerprint() const { return fingerprint_; }
    const Level& level(uint32_t l) const { return levels_[l - 1]; }  // 1-based

    // Context lookup: the node index at level `len` for the last `len` tokens of ctx, or -1.
    int64_t find_context(const token_t* ctx, size_t n_ctx, size_t len) const;
    // count(context + token) / count(context) for the context node at level `len` (0 = root), or
    // kUnseen when `token` never followed that context (or the context's count is 0), so that
    // callers back off to a shorter context.
    double child_ratio(size_t len, int64_t node, token_t token) const;
    static constexpr double kUnseen = -1.0;
    // child_ratio for many tokens at once; `sorted` must be strictly ascending (distinct tokens).
    void child_ratios(size_t len, int64_t node, const token_t* sorted, size_t n, double* out) const;

    // Upstream rule: the longest context (up to order-1 tokens) that exists and has `token` as a
    // child gives count(ctx+token)/count(ctx); no match -> 0 (there is no unigram level).
    double prob(const token_t* ctx, size_t n_ctx, token_t token) const;
    // Same for many tokens sharing one context: each token gets the longest context that has it.
    void probs(const token_t* ctx, size_t n_ctx, const token_t* tokens, size_t n, double* out) const;
    // Interpolated mode: fixed weights over the ML estimates of every context length, with a unigram
    // and a uniform floor, so no token gets 0. See kSmoothWeights in ngram.cpp.
    double smoothed_prob(const token_t* ctx, size_t n_ctx, token_t token) const;

  private:
    NGramModel() = default;
    uint64_t node_count(size_t len, int64_t node) const;  // len 0 = root (the corpus size)
    // Level 1's node of a token: a table lookup for ids the table covers, else a binary search.
    int64_t first_level_node(token_t token) const;
    void index_first_level();
    uint32_t order_ = 0, vocab_size_ = 0;
    bool vocab_known_ = true;
    uint64_t total_ = 0;
    std::string fingerprint_;
    std::vector<Level> levels_;
    std::unique_ptr<Storage> storage_;
    // first_level_[t]: level 1's node of token t, -1 if t is not there. Every context lookup starts
    // with it: one probe, where a binary search over the whole level (tens of thousands of tokens)
    // took ~16, the last few a cache miss each in a pruner step that follows a target forward.
    std::vector<int32_t> first_level_;
};

// Builds the trie from token sequences by sorting n-gram slices; `add` may be called any number of
// times (sequences never share n-grams). Slices spill to sorted run files when `max_slices_in_memory`
// is reached, so a corpus larger than RAM builds in chunks; `finish` merges the runs (once: the
// builder cannot be used afterwards). A buffered slice takes 4 * order bytes, about 2.5x that while
// a run is sorted.
class Builder {
  public:
    Builder(uint32_t order, uint32_t vocab_size, uint64_t max_slices_in_memory, std::string spill_dir);
    ~Builder();
    void add(const token_t* tokens, size_t n);
    std::unique_ptr<NGramModel> finish(const std::string& fingerprint);
    uint64_t slices() const { return n_slices_; }

  private:
    void spill();
    uint32_t order_, vocab_size_;
    uint64_t max_in_memory_, n_slices_ = 0;
    bool finished_ = false;
    std::string spill_dir_;
    std::vector<token_t> buffer_;  // slices of `order` tokens, padded with -1
    std::vector<std::string> runs_;
};

}  // namespace ngram
