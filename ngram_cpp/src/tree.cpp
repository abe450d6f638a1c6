#include "tree.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace ngram {

void ancestor_paths(const int64_t* parents, int64_t n, int64_t width, int32_t* paths, int32_t* lengths) {
    if (n < 0 || width < 1) throw std::invalid_argument("ancestor_paths: n must be >= 0 and width >= 1");
    for (int64_t i = 0; i < n; ++i) {
        const int64_t p = parents[i];
        int32_t* row = paths + i * width;
        int32_t len = 1;
        if (p >= 0) {
            if (p >= i) throw std::invalid_argument("parents[" + std::to_string(i) + "] = " + std::to_string(p) + ": a parent comes before its child");
            len = lengths[p] + 1;
            if (len > width) throw std::invalid_argument("node " + std::to_string(i) + "'s path is longer than " + std::to_string(width));
            std::copy(paths + p * width, paths + p * width + len - 1, row);  // the parent's path, finished before
        } else if (p != -1) {
            throw std::invalid_argument("parents[" + std::to_string(i) + "] = " + std::to_string(p) + ": a parent is a node or -1");
        }
        row[len - 1] = static_cast<int32_t>(i);
        std::fill(row + len, row + width, 0);
        lengths[i] = len;
    }
}

}  // namespace ngram
