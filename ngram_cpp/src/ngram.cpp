#include "ngram.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <queue>
#include <stdexcept>

namespace ngram {

// ------------------------------------------------------------------------------------------------
// Storage: either vectors we own, or a read-only mapping of a compact file.

struct Storage {
    std::vector<std::vector<token_t>> tokens;
    std::vector<std::vector<count_t>> counts;
    std::vector<std::vector<index_t>> first_child;
    void* map = nullptr;
    size_t map_size = 0;
    ~Storage() {
        if (map) munmap(map, map_size);
    }
};

namespace {

constexpr size_t kAlign = 8;
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

std::runtime_error file_error(const std::string& path, const std::string& what) {
    return std::runtime_error(path + ": " + what);
}

// Smoothed mode (interpolation with fixed weights): kUniformWeight / vocab_size for every token, plus
// (1 - kUniformWeight) times the average of the count ratios count(ctx_len + t) / count(ctx_len) over
// the context lengths len = 0..min(order-1, |context|) whose context occurs in the corpus, weighted
// by 2^len so that longer contexts dominate. len 0 is the unigram count(t) / total. Every token gets
// a non-zero probability; over the vocabulary they sum to 1 (less the mass of sequence ends).
constexpr double kUniformWeight = 0.01;

// [lo, hi) child range of `node` at level l (1-based) in level l+1, clamped so that a corrupt file
// can never send a lookup out of bounds.
inline void child_range(const Level& parent, const Level& child, int64_t node, uint64_t* lo, uint64_t* hi) {
    uint64_t a = parent.first_child[node], b = parent.first_child[node + 1];
    if (a > b || b > child.size) a = b = 0;
    *lo = a;
    *hi = b;
}

inline int64_t search(const Level& lv, uint64_t lo, uint64_t hi, token_t t) {
    const token_t* first = lv.tokens + lo;
    const token_t* last = lv.tokens + hi;
    const token_t* it = std::lower_bound(first, last, t);
    return (it != last && *it == t) ? static_cast<int64_t>(it - lv.tokens) : -1;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// NGramModel

NGramModel::NGramModel(uint32_t order, uint32_t vocab_size, uint64_t total, std::vector<std::vector<token_t>> tokens,
                       std::vector<std::vector<count_t>> counts, std::vector<std::vector<index_t>> first_child,
                       std::string fingerprint)
    : order_(order), vocab_size_(vocab_size), total_(total), fingerprint_(std::move(fingerprint)) {
    if (order < 1 || order > kMaxOrder) throw std::invalid_argument("n-gram order must be in 1..8");
    if (fingerprint_.size() >= sizeof(CompactHeader::fingerprint))
        throw std::invalid_argument("tokenizer fingerprint is longer than 63 characters");
    storage_ = std::make_unique<Storage>();
    storage_->tokens = std::move(tokens);
    storage_->counts = std::move(counts);
    storage_->first_child = std::move(first_child);
    levels_.resize(order);
    for (uint32_t l = 0; l < order; ++l) {
        Level& lv = levels_[l];
        lv.size = storage_->tokens[l].size();
        lv.tokens = storage_->tokens[l].data();
        lv.counts = storage_->counts[l].data();
        lv.first_child = l + 1 < order ? storage_->first_child[l].data() : nullptr;
    }
    index_first_level();
}

NGramModel::~NGramModel() = default;

// Token ids up to this bound get a table entry (16 MiB at most); a trie with larger ids (a damaged
// file) keeps the binary search for those.
constexpr size_t kMaxTableTokens = size_t{1} << 22;

void NGramModel::index_first_level() {
    const Level& lv = levels_[0];
    token_t top = -1;
    for (uint64_t i = 0; i < lv.size; ++i) top = std::max(top, lv.tokens[i]);
    first_level_.assign(std::min<size_t>(top < 0 ? 0 : static_cast<size_t>(top) + 1, kMaxTableTokens), -1);
    for (uint64_t i = 0; i < lv.size; ++i) {
        const token_t t = lv.tokens[i];
        // the first occurrence, as the binary search finds it (a valid level holds each token once)
        if (t >= 0 && static_cast<size_t>(t) < first_level_.size() && first_level_[t] < 0) first_level_[t] = static_cast<int32_t>(i);
    }
}

int64_t NGramModel::first_level_node(token_t token) const {
    if (token >= 0 && static_cast<size_t>(token) < first_level_.size()) return first_level_[token];
    return search(levels_[0], 0, levels_[0].size, token);
}

uint64_t NGramModel::num_nodes() const {
    uint64_t n = 1;
    for (const Level& lv : levels_) n += lv.size;
    return n;
}

int64_t NGramModel::find_context(const token_t* ctx, size_t n_ctx, size_t len) const {
    if (len == 0 || len > n_ctx || len >= order_) return -1;
    const token_t* c = ctx + (n_ctx - len);
    int64_t node = first_level_node(c[0]);
    for (size_t l = 1; l < len && node >= 0; ++l) {
        uint64_t lo, hi;
        child_range(levels_[l - 1], levels_[l], node, &lo, &hi);
        node = search(levels_[l], lo, hi, c[l]);
    }
    return node;
}

uint64_t NGramModel::node_count(size_t len, int64_t node) const {
    return len == 0 ? total_ : levels_[len - 1].counts[node];
}

double NGramModel::child_ratio(size_t len, int64_t node, token_t token) const {
    if (len >= order_) return kUnseen;
    uint64_t lo = 0, hi = levels_[0].size;
    if (len > 0) child_range(levels_[len - 1], levels_[len], node, &lo, &hi);
    int64_t child = search(levels_[len], lo, hi, token);
    uint64_t denom = node_count(len, node);
    if (child < 0 || denom == 0) return kUnseen;
    return static_cast<double>(levels_[len].counts[child]) / static_cast<double>(denom);
}

void NGramModel::child_ratios(size_t len, int64_t node, const token_t* sorted, size_t n, double* out) const {
    uint64_t lo = 0, hi = 0;
    if (len < order_) {
        hi = levels_[0].size;
        if (len > 0) child_range(levels_[len - 1], levels_[len], node, &lo, &hi);
    }
    const uint64_t denom = len < order_ ? node_count(len, node) : 0;
    std::fill(out, out + n, kUnseen);
    if (denom == 0 || lo == hi) return;
    const Level& lv = levels_[len];
    auto ratio = [&](uint64_t child) { return static_cast<double>(lv.counts[child]) / static_cast<double>(denom); };
    if (hi - lo < n) {
        // few children (the usual case for a long context): look each one up among the tokens
        const token_t* tok_end = sorted + n;
        for (uint64_t j = lo; j < hi; ++j) {
            const token_t* it = std::lower_bound(sorted, tok_end, lv.tokens[j]);
            if (it != tok_end && *it == lv.tokens[j]) out[it - sorted] = ratio(j);
        }
        return;
    }
    const token_t* first = lv.tokens + lo;
    const token_t* last = lv.tokens + hi;
    for (size_t i = 0; i < n && first != last; ++i) {
        first = std::lower_bound(first, last, sorted[i]);  // the tokens ascend, so the range only shrinks
        if (first != last && *first == sorted[i]) out[i] = ratio(static_cast<uint64_t>(first - lv.tokens));
    }
}

double NGramModel::prob(const token_t* ctx, size_t n_ctx, token_t token) const {
    double out;
    probs(ctx, n_ctx, &token, 1, &out);
    return out;
}

void NGramModel::probs(const token_t* ctx, size_t n_ctx, const token_t* tokens, size_t n, double* out) const {
    size_t max_len = std::min<size_t>(order_ - 1, n_ctx);
    int64_t nodes[kMaxOrder];
    for (size_t len = 1; len <= max_len; ++len) nodes[len] = find_context(ctx, n_ctx, len);
    for (size_t i = 0; i < n; ++i) {
        out[i] = 0.0;
        for (size_t len = max_len; len >= 1; --len) {
            if (nodes[len] < 0) continue;
            double r = child_ratio(len, nodes[len], tokens[i]);
            if (r != kUnseen) {
                out[i] = r;
                break;
            }
        }
    }
}

double NGramModel::smoothed_prob(const token_t* ctx, size_t n_ctx, token_t token) const {
    double weight_sum = 0.0, p = 0.0;
    for (size_t len = 0; len < order_ && len <= n_ctx; ++len) {
        int64_t node = len == 0 ? 0 : find_context(ctx, n_ctx, len);
        if (node < 0 || node_count(len, node) == 0) continue;
        const double w = static_cast<double>(1u << len);
        weight_sum += w;
        double r = child_ratio(len, node, token);
        if (r != kUnseen) p += w * r;
    }
    const double floor = kUniformWeight / std::max<uint32_t>(vocab_size_, 1);
    return weight_sum > 0 ? (1.0 - kUniformWeight) * (p / weight_sum) + floor : floor;
}

void NGramModel::set_metadata(uint32_t vocab_size, const std::string& fingerprint) {
    if (vocab_size < vocab_size_)
        throw std::invalid_argument("vocab_size " + std::to_string(vocab_size) + " is smaller than the trie's largest token id + 1 (" +
                                    std::to_string(vocab_size_) + ")");
    if (fingerprint.size() >= sizeof(CompactHeader::fingerprint))
        throw std::invalid_argument("tokenizer fingerprint is longer than 63 characters");
    vocab_size_ = vocab_size;
    vocab_known_ = true;
    fingerprint_ = fingerprint;
}

// ------------------------------------------------------------------------------------------------
// Compact format

void NGramModel::save_compact(const std::string& path) const {
    CompactHeader h{};
    std::memcpy(h.magic, kCompactMagic, sizeof(h.magic));
    h.version = kCompactVersion;
    h.order = order_;
    h.vocab_size = vocab_size_;
    h.flags = vocab_known_ ? 0u : kFlagVocabIsLowerBound;
    h.total = total_;
    for (uint32_t l = 0; l < order_; ++l) h.level_size[l] = levels_[l].size;
    std::strncpy(h.fingerprint, fingerprint_.c_str(), sizeof(h.fingerprint) - 1);

    std::string tmp = path + ".tmp";
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw file_error(path, "cannot open for writing");
    static const char zeros[kAlign] = {};
    size_t pos = 0;
    auto put = [&](const void* data, size_t bytes) {
        f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
        pos += bytes;
        size_t pad = align_up(pos) - pos;
        f.write(zeros, static_cast<std::streamsize>(pad));
        pos += pad;
    };
    put(&h, sizeof(h));
    for (uint32_t l = 0; l < order_; ++l) {
        const Level& lv = levels_[l];
        put(lv.tokens, lv.size * sizeof(token_t));
        put(lv.counts, lv.size * sizeof(count_t));
        if (l + 1 < order_) put(lv.first_child, (lv.size + 1) * sizeof(index_t));
    }
    f.close();
    if (!f) throw file_error(path, "write failed");
    if (std::rename(tmp.c_str(), path.c_str()) != 0) throw file_error(path, "cannot rename temporary file");
}

std::unique_ptr<NGramModel> NGramModel::load_compact(const std::string& path) {
    int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) throw file_error(path, std::string("cannot open: ") + std::strerror(errno));
    struct stat st {};
    if (fstat(fd, &st) != 0) {
        ::close(fd);
        throw file_error(path, "cannot stat");
    }
    size_t size = static_cast<size_t>(st.st_size);
    if (size < sizeof(CompactHeader)) {
        ::close(fd);
        throw file_error(path, "truncated: smaller than the compact header");
    }
    void* map = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (map == MAP_FAILED) throw file_error(path, "mmap failed");
    auto storage = std::make_unique<Storage>();
    storage->map = map;
    storage->map_size = size;

    CompactHeader h;
    std::memcpy(&h, map, sizeof(h));
    if (std::memcmp(h.magic, kCompactMagic, sizeof(h.magic)) != 0) throw file_error(path, "not a compact n-gram file (bad magic)");
    if (h.version != kCompactVersion)
        throw file_error(path, "unsupported compact format version " + std::to_string(h.version));
    if (h.order < 1 || h.order > kMaxOrder) throw file_error(path, "invalid order " + std::to_string(h.order));
    if (h.fingerprint[sizeof(h.fingerprint) - 1] != '\0') throw file_error(path, "corrupt header (fingerprint)");
    if (h.flags & ~kKnownFlags) throw file_error(path, "corrupt header (unknown flags)");
    for (uint32_t l = h.order; l < kMaxOrder; ++l)
        if (h.level_size[l] != 0) throw file_error(path, "corrupt header (levels beyond the order)");

    // Every array must lie inside the file; sizes are checked before any pointer is formed.
    std::unique_ptr<NGramModel> m(new NGramModel());
    m->order_ = h.order;
    m->vocab_size_ = h.vocab_size;
    m->vocab_known_ = (h.flags & kFlagVocabIsLowerBound) == 0;
    m->total_ = h.total;
    m->fingerprint_ = std::string(h.fingerprint);
    m->levels_.resize(h.order);
    size_t pos = align_up(sizeof(CompactHeader));
    const char* base = static_cast<const char*>(map);
    auto take = [&](uint64_t count, size_t elem) -> const char* {
        if (count > (size - pos) / elem) throw file_error(path, "truncated or corrupt: level arrays exceed the file");
        const char* p = base + pos;
        pos = align_up(pos + count * elem);
        if (pos > size) pos = size;
        return p;
    };
    for (uint32_t l = 0; l < h.order; ++l) {
        Level& lv = m->levels_[l];
        lv.size = h.level_size[l];
        lv.tokens = reinterpret_cast<const token_t*>(take(lv.size, sizeof(token_t)));
        lv.counts = reinterpret_cast<const count_t*>(take(lv.size, sizeof(count_t)));
        if (l + 1 < h.order) {
            if (lv.size == UINT64_MAX) throw file_error(path, "corrupt level size");
            lv.first_child = reinterpret_cast<const index_t*>(take(lv.size + 1, sizeof(index_t)));
        }
    }
    if (pos != size) throw file_error(path, "corrupt: file size does not match the header's level sizes");
    // Cheap boundary checks (O(order)); `validate()` checks everything.
    for (uint32_t l = 0; l + 1 < h.order; ++l) {
        const Level& lv = m->levels_[l];
        if (lv.first_child[0] != 0 || lv.first_child[lv.size] != m->levels_[l + 1].size)
            throw file_error(path, "corrupt: child index ranges do not match level sizes");
    }
    m->storage_ = std::move(storage);
    m->index_first_level();
    return m;
}

void NGramModel::validate() const {
    uint64_t level1_sum = 0;
    for (uint32_t l = 0; l < order_; ++l) {
        const Level& lv = levels_[l];
        for (uint64_t i = 0; i < lv.size; ++i) {
            if (lv.tokens[i] < 0 || static_cast<uint32_t>(lv.tokens[i]) >= vocab_size_)
                throw std::runtime_error("level " + std::to_string(l + 1) + ": token out of range");
        }
        // (zero counts are legal: upstream's reduce() can leave a kept node at 0)
        if (l == 0) {
            for (uint64_t i = 0; i < lv.size; ++i) level1_sum += lv.counts[i];
            for (uint64_t i = 1; i < lv.size; ++i)
                if (lv.tokens[i - 1] >= lv.tokens[i]) throw std::runtime_error("level 1: tokens not strictly sorted");
        }
        if (l + 1 == order_) continue;
        const Level& next = levels_[l + 1];
        if (lv.first_child[0] != 0 || lv.first_child[lv.size] != next.size)
            throw std::runtime_error("level " + std::to_string(l + 1) + ": child ranges do not cover the next level");
        for (uint64_t i = 0; i < lv.size; ++i) {
            uint64_t lo = lv.first_child[i], hi = lv.first_child[i + 1];
            if (lo > hi || hi > next.size) throw std::runtime_error("level " + std::to_string(l + 1) + ": bad child range");
            uint64_t child_sum = 0;
            for (uint64_t j = lo; j < hi; ++j) {
                if (j > lo && next.tokens[j - 1] >= next.tokens[j])
                    throw std::runtime_error("level " + std::to_string(l + 2) + ": children not strictly sorted");
                child_sum += next.counts[j];
            }
            if (child_sum > lv.counts[i])
                throw std::runtime_error("level " + std::to_string(l + 2) + ": children count more than their parent");
        }
    }
    if (level1_sum != total_) throw std::runtime_error("root count does not equal the sum of level-1 counts");
}

// ------------------------------------------------------------------------------------------------
// Upstream format (fvliang/DART trie_ngram.cpp): u64 order, u64 node_count, then per node
// i32 token, u64 parent, i32 freq, u64 n_children, n_children x (i32 token, u64 index). No padding.

namespace {

class Reader {
  public:
    explicit Reader(const std::string& path) : path_(path), f_(path, std::ios::binary) {
        if (!f_) throw file_error(path, "cannot open");
        f_.seekg(0, std::ios::end);
        remaining_ = static_cast<uint64_t>(f_.tellg());
        f_.seekg(0);
        buf_.resize(1 << 20);
    }
    template <typename T>
    T get() {
        T v;
        read(&v, sizeof(T));
        return v;
    }
    uint64_t remaining() const { return remaining_ + (end_ - at_); }

  private:
    void read(void* out, size_t n) {
        char* o = static_cast<char*>(out);
        while (n > 0) {
            if (at_ == end_) {
                size_t want = static_cast<size_t>(std::min<uint64_t>(buf_.size(), remaining_));
                if (want == 0) throw file_error(path_, "truncated upstream .trie file");
                f_.read(buf_.data(), static_cast<std::streamsize>(want));
                if (!f_) throw file_error(path_, "read error");
                remaining_ -= want;
                at_ = 0;
                end_ = want;
            }
            size_t k = std::min(n, end_ - at_);
            std::memcpy(o, buf_.data() + at_, k);
            at_ += k;
            o += k;
            n -= k;
        }
    }
    std::string path_;
    std::ifstream f_;
    uint64_t remaining_ = 0;
    std::vector<char> buf_;
    size_t at_ = 0, end_ = 0;
};

}  // namespace

std::unique_ptr<NGramModel> NGramModel::load_upstream(const std::string& path) {
    Reader r(path);
    if (r.remaining() < 16) throw file_error(path, "truncated: no upstream .trie header");
    uint64_t order = r.get<uint64_t>();
    uint64_t n_nodes = r.get<uint64_t>();
    if (order < 1 || order > kMaxOrder) throw file_error(path, "invalid order " + std::to_string(order));
    constexpr uint64_t kRecord = 24, kChild = 12;
    if (n_nodes == 0 || n_nodes > r.remaining() / kRecord) throw file_error(path, "corrupt: node count exceeds the file size");

    // freq is an int32 upstream; read it as the uint32 it was counting, so counts in [2^31, 2^32)
    // that upstream's int32 wrapped around come back right.
    std::vector<count_t> freq(n_nodes);
    std::vector<uint64_t> child_start(n_nodes + 1);
    std::vector<std::pair<token_t, uint64_t>> children;
    std::vector<token_t> node_token(n_nodes);
    std::vector<uint64_t> node_parent(n_nodes);
    for (uint64_t i = 0; i < n_nodes; ++i) {
        node_token[i] = r.get<int32_t>();
        node_parent[i] = r.get<uint64_t>();
        freq[i] = r.get<uint32_t>();
        uint64_t nc = r.get<uint64_t>();
        if (nc > r.remaining() / kChild) throw file_error(path, "corrupt: child count exceeds the file size");
        if (nc > n_nodes - 1) throw file_error(path, "corrupt: more children than nodes");
        child_start[i] = children.size();
        for (uint64_t c = 0; c < nc; ++c) {
            token_t t = r.get<int32_t>();
            uint64_t idx = r.get<uint64_t>();
            if (idx == 0 || idx >= n_nodes) throw file_error(path, "corrupt: child index out of range");
            children.emplace_back(t, idx);
        }
        if (children.size() > n_nodes - 1) throw file_error(path, "corrupt: more child links than nodes");
    }
    child_start[n_nodes] = children.size();
    if (r.remaining() != 0) throw file_error(path, "corrupt: trailing bytes after the last node");

    // Breadth-first from the root, children sorted by token, into level arrays.
    std::vector<std::vector<token_t>> tokens(order);
    std::vector<std::vector<count_t>> counts(order);
    std::vector<std::vector<index_t>> first_child(order > 1 ? order - 1 : 0);
    std::vector<uint8_t> seen(n_nodes, 0);
    seen[0] = 1;
    std::vector<uint64_t> frontier{0}, next;
    uint32_t vocab = 0;
    for (uint64_t depth = 0; depth <= order && !frontier.empty(); ++depth) {
        next.clear();
        for (uint64_t node : frontier) {
            std::vector<std::pair<token_t, uint64_t>> kids(children.begin() + child_start[node],
                                                          children.begin() + child_start[node + 1]);
            if (!kids.empty() && depth == order) throw file_error(path, "corrupt: trie deeper than its order");
            std::sort(kids.begin(), kids.end());
            if (depth >= 1 && depth < order) first_child[depth - 1].push_back(tokens[depth].size());
            uint64_t kids_count = 0;
            for (size_t k = 0; k < kids.size(); ++k) {
                auto [t, idx] = kids[k];
                if (k > 0 && kids[k - 1].first == t) throw file_error(path, "corrupt: duplicate child token");
                if (seen[idx]) throw file_error(path, "corrupt: a node has two parents");
                if (t < 0) throw file_error(path, "corrupt: negative token id");
                if (node_token[idx] != t || node_parent[idx] != node) throw file_error(path, "corrupt: child record disagrees with its parent");
                seen[idx] = 1;
                vocab = std::max<uint32_t>(vocab, static_cast<uint32_t>(t) + 1);
                tokens[depth].push_back(t);
                counts[depth].push_back(freq[idx]);
                next.push_back(idx);
                kids_count += freq[idx];
            }
            // every occurrence of a continuation is an occurrence of its context (the root is recomputed below)
            if (depth >= 1 && kids_count > freq[node]) throw file_error(path, "corrupt: children count more than their parent");
        }
        if (depth >= 1 && depth < order) first_child[depth - 1].push_back(tokens[depth].size());
        frontier.swap(next);
    }
    for (uint64_t i = 0; i < n_nodes; ++i)
        if (!seen[i]) throw file_error(path, "corrupt: node " + std::to_string(i) + " is unreachable from the root");
    // A trie shallower than its order (the walk ran out of nodes, e.g. a root alone) left the child
    // index of its empty levels unwritten: an empty level's index is the one sentinel 0, as the compact
    // format stores it, so lookups and validate() never read past an empty array.
    for (auto& index : first_child)
        if (index.empty()) index.push_back(0);
    // The root's freq counts every token of the corpus, i.e. it equals the sum of level 1; take the
    // sum, which stays right where upstream's int32 root overflowed or reduce() made it negative.
    uint64_t total = 0;
    for (count_t c : counts[0]) total += c;
    auto model = std::make_unique<NGramModel>(static_cast<uint32_t>(order), vocab, total, std::move(tokens), std::move(counts),
                                              std::move(first_child), std::string());
    model->vocab_known_ = false;
    return model;
}

void NGramModel::save_upstream(const std::string& path) const {
    validate();  // the parent walk below relies on well-formed child ranges (a mapped file may not have them)
    // Node indices in breadth-first order: root 0, then level 1, level 2, ...
    std::vector<uint64_t> level_base(order_ + 1, 1);
    for (uint32_t l = 1; l <= order_; ++l) level_base[l] = level_base[l - 1] + (l == 1 ? 0 : levels_[l - 2].size);
    // level_base[l] = index of the first node of level l (1-based levels)
    std::string tmp = path + ".tmp";
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw file_error(path, "cannot open for writing");
    std::vector<char> buf;
    buf.reserve(1 << 20);
    auto put = [&](const void* p, size_t n) {
        buf.insert(buf.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n);
        if (buf.size() >= (1 << 20)) {
            f.write(buf.data(), static_cast<std::streamsize>(buf.size()));
            buf.clear();
        }
    };
    // Counts go out as the low 32 bits, which is what upstream's int32 freq holds after wrapping.
    auto put_node = [&](token_t token, uint64_t parent, uint64_t count, uint32_t child_level, uint64_t lo, uint64_t hi) {
        uint32_t freq = static_cast<uint32_t>(count);
        uint64_t nc = hi - lo;
        put(&token, 4);
        put(&parent, 8);
        put(&freq, 4);
        put(&nc, 8);
        for (uint64_t j = lo; j < hi; ++j) {
            token_t t = levels_[child_level - 1].tokens[j];
            uint64_t idx = level_base[child_level] + j;
            put(&t, 4);
            put(&idx, 8);
        }
    };
    uint64_t order64 = order_, n_nodes = num_nodes();
    put(&order64, 8);
    put(&n_nodes, 8);
    put_node(0, 0, total_, 1, 0, levels_[0].size);
    for (uint32_t l = 1; l <= order_; ++l) {
        const Level& lv = levels_[l - 1];
        // parent of node j at level l: the level-(l-1) node whose child range holds j
        uint64_t parent_idx = 0;
        for (uint64_t j = 0; j < lv.size; ++j) {
            uint64_t parent = 0;
            if (l > 1) {
                const Level& pl = levels_[l - 2];
                while (pl.first_child[parent_idx + 1] <= j) ++parent_idx;
                parent = level_base[l - 1] + parent_idx;
            }
            uint64_t lo = 0, hi = 0;
            if (l < order_) {
                lo = lv.first_child[j];
                hi = lv.first_child[j + 1];
            }
            put_node(lv.tokens[j], parent, lv.counts[j], l + 1, lo, hi);
        }
    }
    f.write(buf.data(), static_cast<std::streamsize>(buf.size()));
    f.close();
    if (!f) throw file_error(path, "write failed");
    if (std::rename(tmp.c_str(), path.c_str()) != 0) throw file_error(path, "cannot rename temporary file");
}

// ------------------------------------------------------------------------------------------------
// Builder

namespace {

// Streams sorted slices into level arrays: consecutive slices share their common prefix's nodes.
class LevelWriter {
  public:
    explicit LevelWriter(uint32_t order) : order_(order), tokens(order), counts(order), first_child(order - 1), path_(order, -2) {}

    void push(const token_t* s) {
        ++total;
        bool diverged = false;
        for (uint32_t l = 0; l < order_; ++l) {
            if (s[l] < 0) break;
            if (diverged || s[l] != path_[l]) {
                diverged = true;
                path_[l] = s[l];
                if (l + 1 < order_) first_child[l].push_back(tokens[l + 1].size());
                tokens[l].push_back(s[l]);
                counts[l].push_back(0);
            }
            count_t& c = counts[l].back();
            if (c == UINT32_MAX) throw std::overflow_error("an n-gram count exceeds 2^32-1");
            ++c;
        }
        // A slice cut short by the end of its sequence ends the path there: the next slice must open
        // new nodes below that point even if its tokens match what the path held before.
        for (uint32_t l = 0; l < order_; ++l)
            if (s[l] < 0) path_[l] = -2;
    }
    void finish() {
        for (uint32_t l = 0; l + 1 < order_; ++l) first_child[l].push_back(tokens[l + 1].size());
    }

    uint32_t order_;
    uint64_t total = 0;
    std::vector<std::vector<token_t>> tokens;
    std::vector<std::vector<count_t>> counts;
    std::vector<std::vector<index_t>> first_child;

  private:
    std::vector<token_t> path_;
};

struct RunReader {
    FILE* f = nullptr;
    std::vector<token_t> buf;
    size_t at = 0, n = 0;  // slices in buf
    uint32_t order;
    RunReader(const std::string& path, uint32_t order_) : order(order_) {
        f = std::fopen(path.c_str(), "rb");
        if (!f) throw file_error(path, "cannot reopen spill file");
        buf.resize(static_cast<size_t>(order) * 65536);
        refill();
    }
    ~RunReader() {
        if (f) std::fclose(f);
    }
    void refill() {
        n = std::fread(buf.data(), sizeof(token_t) * order, 65536, f);
        at = 0;
    }
    const token_t* head() const { return n ? buf.data() + at * order : nullptr; }
    void pop() {
        if (++at == n) refill();
    }
};

}  // namespace

Builder::Builder(uint32_t order, uint32_t vocab_size, uint64_t max_slices_in_memory, std::string spill_dir)
    // (at most 2^32 - 1: a run is sorted through 32-bit slice indices)
    : order_(order),
      vocab_size_(vocab_size),
      max_in_memory_(std::clamp<uint64_t>(max_slices_in_memory, 1, UINT32_MAX)),
      spill_dir_(std::move(spill_dir)) {
    if (order < 1 || order > kMaxOrder) throw std::invalid_argument("n-gram order must be in 1..8");
    if (vocab_size == 0) throw std::invalid_argument("vocab_size must be positive");
}

Builder::~Builder() {
    for (const std::string& r : runs_) std::remove(r.c_str());
}

void Builder::add(const token_t* tokens, size_t n) {
    if (finished_) throw std::logic_error("the n-gram builder has already finished");
    for (size_t i = 0; i < n; ++i)
        if (tokens[i] < 0 || static_cast<uint32_t>(tokens[i]) >= vocab_size_)
            throw std::invalid_argument("token id " + std::to_string(tokens[i]) + " out of range [0, " + std::to_string(vocab_size_) + ")");
    for (size_t s = 0; s < n; ++s) {
        for (uint32_t l = 0; l < order_; ++l) buffer_.push_back(s + l < n ? tokens[s + l] : -1);
        ++n_slices_;
        if (buffer_.size() / order_ >= max_in_memory_) spill();
    }
}

namespace {
void sort_slices(std::vector<token_t>& buf, uint32_t order) {
    size_t n = buf.size() / order;
    std::vector<uint32_t> idx(n);
    std::iota(idx.begin(), idx.end(), 0u);
    const token_t* b = buf.data();
    std::sort(idx.begin(), idx.end(), [b, order](uint32_t x, uint32_t y) {
        return std::lexicographical_compare(b + size_t(x) * order, b + size_t(x) * order + order, b + size_t(y) * order,
                                            b + size_t(y) * order + order);
    });
    std::vector<token_t> sorted(buf.size());
    for (size_t i = 0; i < n; ++i) std::memcpy(&sorted[i * order], b + size_t(idx[i]) * order, order * sizeof(token_t));
    buf.swap(sorted);
}
}  // namespace

void Builder::spill() {
    if (buffer_.empty()) return;
    sort_slices(buffer_, order_);
    std::string path = spill_dir_ + "/ngram-run-" + std::to_string(::getpid()) + "-" + std::to_string(runs_.size()) + ".bin";
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) throw file_error(path, "cannot create spill file");
    size_t written = std::fwrite(buffer_.data(), sizeof(token_t), buffer_.size(), f);
    std::fclose(f);
    if (written != buffer_.size()) throw file_error(path, "short write to spill file");
    runs_.push_back(path);
    buffer_.clear();
    buffer_.shrink_to_fit();
}

std::unique_ptr<NGramModel> Builder::finish(const std::string& fingerprint) {
    if (finished_) throw std::logic_error("the n-gram builder has already finished");
    finished_ = true;
    LevelWriter w(order_);
    if (runs_.empty()) {
        sort_slices(buffer_, order_);
        for (size_t i = 0; i < buffer_.size(); i += order_) w.push(&buffer_[i]);
        buffer_.clear();
    } else {
        spill();
        std::vector<std::unique_ptr<RunReader>> readers;
        for (const std::string& r : runs_) readers.push_back(std::make_unique<RunReader>(r, order_));
        uint32_t order = order_;
        auto greater = [&](size_t a, size_t b) {
            return std::lexicographical_compare(readers[b]->head(), readers[b]->head() + order, readers[a]->head(),
                                                readers[a]->head() + order);
        };
        std::priority_queue<size_t, std::vector<size_t>, decltype(greater)> heap(greater);
        for (size_t i = 0; i < readers.size(); ++i)
            if (readers[i]->head()) heap.push(i);
        while (!heap.empty()) {
            size_t i = heap.top();
            heap.pop();
            w.push(readers[i]->head());
            readers[i]->pop();
            if (readers[i]->head()) heap.push(i);
        }
    }
    w.finish();
    return std::make_unique<NGramModel>(order_, vocab_size_, w.total, std::move(w.tokens), std::move(w.counts),
                                        std::move(w.first_child), fingerprint);
}

}  // namespace ngram
