// Tree layouts the verifier's inputs need, built on the host once a step while the device waits.
#pragma once

#include <cstdint>

namespace ngram {

// Each node's path from its root for a tree given by parent links (parents[i] < i; -1 for a root):
// row i of `paths` (n rows of `width`) holds the path's nodes root first and i last, then zeros;
// lengths[i] is its length (the node's depth + 1). Throws std::invalid_argument on a parent that does
// not come before its child, or a path longer than `width`.
void ancestor_paths(const int64_t* parents, int64_t n, int64_t width, int32_t* paths, int32_t* lengths);

}  // namespace ngram
