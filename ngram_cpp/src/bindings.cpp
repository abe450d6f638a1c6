// Python bindings: arrays cross as contiguous numpy arrays; C++ exceptions become ValueError
// (std::invalid_argument) or RuntimeError (everything else, e.g. a corrupt file).
#include <pybind11/numpy.h>
#include <chrono>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "context.h"
#include "ngram.h"
#include "pruner.h"
#include "tree.h"

namespace py = pybind11;
using namespace ngram;

namespace {

template <typename T>
using carray = py::array_t<T, py::array::c_style | py::array::forcecast>;

std::vector<token_t> to_tokens(const carray<int64_t>& a, const char* what) {
    if (a.ndim() != 1) throw std::invalid_argument(std::string(what) + " must be 1-D");
    std::vector<token_t> out(static_cast<size_t>(a.shape(0)));
    const int64_t* p = a.data();
    for (size_t i = 0; i < out.size(); ++i) {
        if (p[i] < 0 || p[i] > INT32_MAX) throw std::invalid_argument(std::string(what) + ": token id " + std::to_string(p[i]) + " out of range");
        out[i] = static_cast<token_t>(p[i]);
    }
    return out;
}

template <typename T>
py::array_t<T> to_numpy(std::vector<T>&& v, std::vector<py::ssize_t> shape) {
    auto* heap = new std::vector<T>(std::move(v));
    py::capsule owner(heap, [](void* p) { delete static_cast<std::vector<T>*>(p); });
    return py::array_t<T>(shape, heap->data(), owner);
}

}  // namespace

PYBIND11_MODULE(_ngram, m) {
    m.doc() = "C++ n-gram trie (upstream .trie and memory-mapped compact formats) and DART's tree pruner";

    py::class_<NGramModel>(m, "NGramModel")
        .def_static("load_compact", &NGramModel::load_compact, py::arg("path"), py::call_guard<py::gil_scoped_release>())
        .def_static("load_upstream", &NGramModel::load_upstream, py::arg("path"), py::call_guard<py::gil_scoped_release>())
        .def("save_compact", &NGramModel::save_compact, py::arg("path"), py::call_guard<py::gil_scoped_release>())
        .def("save_upstream", &NGramModel::save_upstream, py::arg("path"), py::call_guard<py::gil_scoped_release>())
        .def("validate", &NGramModel::validate, py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("order", &NGramModel::order)
        .def_property_readonly("vocab_size", &NGramModel::vocab_size)
        .def_property_readonly("vocab_known", &NGramModel::vocab_known)
        .def("set_metadata", &NGramModel::set_metadata, py::arg("vocab_size"), py::arg("fingerprint"))
        .def_property_readonly("total", &NGramModel::total)
        .def_property_readonly("num_nodes", &NGramModel::num_nodes)
        .def_property_readonly("fingerprint", &NGramModel::fingerprint)
        .def(
            "prob",
            [](const NGramModel& self, const carray<int64_t>& context, int64_t token, bool smoothed) {
                std::vector<token_t> ctx = to_tokens(context, "context");
                if (token < 0 || token > INT32_MAX) throw std::invalid_argument("token id out of range");
                auto t = static_cast<token_t>(token);
                return smoothed ? self.smoothed_prob(ctx.data(), ctx.size(), t) : self.prob(ctx.data(), ctx.size(), t);
            },
            py::arg("context"), py::arg("token"), py::arg("smoothed") = false)
        .def(
            "probs",
            [](const NGramModel& self, const carray<int64_t>& context, const carray<int64_t>& tokens, bool smoothed) {
                std::vector<token_t> ctx = to_tokens(context, "context");
                std::vector<token_t> toks = to_tokens(tokens, "tokens");
                std::vector<double> out(toks.size());
                if (smoothed) {
                    for (size_t i = 0; i < toks.size(); ++i) out[i] = self.smoothed_prob(ctx.data(), ctx.size(), toks[i]);
                } else {
                    self.probs(ctx.data(), ctx.size(), toks.data(), toks.size(), out.data());
                }
                return to_numpy(std::move(out), {static_cast<py::ssize_t>(toks.size())});
            },
            py::arg("context"), py::arg("tokens"), py::arg("smoothed") = false)
        .def(
            "level_arrays",
            [](const NGramModel& self, uint32_t level) {
                if (level < 1 || level > self.order()) throw std::invalid_argument("level must be in 1..order");
                const Level& lv = self.level(level);
                std::vector<int64_t> tok(lv.tokens, lv.tokens + lv.size);
                std::vector<int64_t> cnt(lv.counts, lv.counts + lv.size);
                std::vector<int64_t> fc;
                if (lv.first_child) fc.assign(lv.first_child, lv.first_child + lv.size + 1);
                auto n = static_cast<py::ssize_t>(lv.size);
                auto n_fc = static_cast<py::ssize_t>(fc.size());
                return py::make_tuple(to_numpy(std::move(tok), {n}), to_numpy(std::move(cnt), {n}), to_numpy(std::move(fc), {n_fc}));
            },
            py::arg("level"),
            "Copies of one level's (tokens, counts, first_child) arrays as int64 numpy arrays (first_child is empty for the "
            "last level), for tests and tools.");

    m.def(
        "time_lookups",
        [](const NGramModel& model, const carray<int64_t>& contexts, const carray<int64_t>& tokens, int64_t repeats) {
            if (contexts.ndim() != 2 || tokens.ndim() != 2 || contexts.shape(0) != tokens.shape(0))
                throw std::invalid_argument("contexts [n, c] and tokens [n, m] must have the same n");
            if (repeats < 1) throw std::invalid_argument("repeats must be >= 1");
            const auto n = static_cast<size_t>(contexts.shape(0)), c = static_cast<size_t>(contexts.shape(1)),
                       m = static_cast<size_t>(tokens.shape(1));
            std::vector<token_t> ctx = to_tokens(contexts.attr("reshape")(-1).cast<carray<int64_t>>(), "contexts");
            std::vector<token_t> tok = to_tokens(tokens.attr("reshape")(-1).cast<carray<int64_t>>(), "tokens");
            std::vector<double> out(m);
            double sink = 0.0;
            py::gil_scoped_release release;
            auto t0 = std::chrono::steady_clock::now();
            for (int64_t r = 0; r < repeats; ++r)
                for (size_t i = 0; i < n; ++i) {
                    model.probs(ctx.data() + i * c, c, tok.data() + i * m, m, out.data());
                    sink += out[0];
                }
            auto t1 = std::chrono::steady_clock::now();
            volatile double keep = sink;  // the lookups must not be optimised away
            (void)keep;
            return std::chrono::duration<double, std::micro>(t1 - t0).count() / static_cast<double>(n * repeats);
        },
        py::arg("model"), py::arg("contexts"), py::arg("tokens"), py::arg("repeats"),
        "Mean microseconds of one native probs(context, tokens[i]) call (row i of contexts [n, c] and tokens [n, m]), "
        "timed in C++ without the Python call overhead.");

    py::class_<Builder>(m, "Builder")
        .def(py::init<uint32_t, uint32_t, uint64_t, std::string>(), py::arg("order"), py::arg("vocab_size"),
             py::arg("max_slices_in_memory"), py::arg("spill_dir"))
        .def(
            "add",
            [](Builder& self, const carray<int64_t>& tokens) {
                std::vector<token_t> t = to_tokens(tokens, "tokens");
                py::gil_scoped_release release;
                self.add(t.data(), t.size());
            },
            py::arg("tokens"))
        .def("finish", &Builder::finish, py::arg("fingerprint"), py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("slices", &Builder::slices);

    py::class_<PruneParams>(m, "PruneParams")
        .def(py::init<>())
        .def_readwrite("top_k", &PruneParams::top_k)
        .def_readwrite("beam_width", &PruneParams::beam_width)
        .def_readwrite("max_nodes", &PruneParams::max_nodes)
        .def_readwrite("level_exponent", &PruneParams::level_exponent)
        .def_readwrite("logit_decay", &PruneParams::logit_decay)
        .def_readwrite("ngram_weight", &PruneParams::ngram_weight)
        .def_readwrite("use_ngram", &PruneParams::use_ngram)
        .def_readwrite("ngram_on_first_level", &PruneParams::ngram_on_first_level)
        .def_readwrite("eps", &PruneParams::eps)
        .def_readwrite("context_weight", &PruneParams::context_weight)
        .def_readwrite("context_min_match", &PruneParams::context_min_match)
        .def_readwrite("context_extend", &PruneParams::context_extend)
        .def_readwrite("context_extend_min_match", &PruneParams::context_extend_min_match)
        .def_readwrite("context_max_candidates", &PruneParams::context_max_candidates)
        .def_readwrite("min_score", &PruneParams::min_score)
        .def_readwrite("min_nodes", &PruneParams::min_nodes)
        .def_readwrite("acceptance", &PruneParams::acceptance)
        .def_readwrite("row_costs", &PruneParams::row_costs);

    m.attr("ACCEPTANCE_FEATURES") = kAcceptanceFeatures;
    m.def(
        "acceptance_features",
        [](double score, double inc, bool head, double p, int64_t rank, bool head_row, double row_top, double q, int match, int max_order,
           double c, double parent_fit) {
            std::vector<double> x(kAcceptanceFeatures);
            acceptance_features(score, inc, head, p, rank, head_row, row_top, q, match, max_order, c, parent_fit, x.data());
            return x;
        },
        "The fitted ranking's features of one candidate (ngram_cpp/src/pruner.h); the Python reference's must equal them");

    py::class_<ContextIndex>(m, "ContextIndex")
        .def(py::init<int>(), py::arg("max_order"))
        .def(
            "extend",
            [](ContextIndex& self, const carray<int64_t>& tokens) {
                std::vector<token_t> t = to_tokens(tokens, "tokens");
                self.extend(t.data(), t.size());
            },
            py::arg("tokens"))
        .def("__len__", &ContextIndex::size)
        .def_property_readonly("max_order", &ContextIndex::max_order)
        .def(
            "lookup",
            [](const ContextIndex& self, const carray<int64_t>& virt, int min_len) {
                std::vector<token_t> v = to_tokens(virt, "virtual tokens");
                Continuations c;
                int m = self.lookup(v.data(), v.size(), min_len, c);
                py::dict counts;
                for (const auto& tc : c.counts) counts[py::int_(tc.first)] = tc.second;
                return py::make_tuple(m, counts, c.last);
            },
            py::arg("virtual_tokens"), py::arg("min_len") = 1,
            "(match length, {token: count}, most recent continuation) for the longest earlier occurrence of a suffix of "
            "the indexed tokens + virtual_tokens");

    m.def(
        "prune",
        [](const carray<int64_t>& tokens, const carray<float>& probs, int64_t root, const carray<int64_t>& context,
           const NGramModel* model, const PruneParams& params, int64_t eos_id, const ContextIndex* index, bool layouts) {
            if (tokens.ndim() != 2 || probs.ndim() != 2) throw std::invalid_argument("tokens and probs must be 2-D [d, k]");
            if (tokens.shape(0) != probs.shape(0) || tokens.shape(1) != probs.shape(1))
                throw std::invalid_argument("tokens and probs shapes differ: [" + std::to_string(tokens.shape(0)) + ", " +
                                            std::to_string(tokens.shape(1)) + "] vs [" + std::to_string(probs.shape(0)) + ", " +
                                            std::to_string(probs.shape(1)) + "]");
            if (context.ndim() != 1) throw std::invalid_argument("context must be 1-D");
            PrunedTree t;
            {
                py::gil_scoped_release release;
                t = (layouts ? prune : prune_nodes)(tokens.data(), probs.data(), tokens.shape(0), tokens.shape(1), root, context.data(),
                                                    context.shape(0), model, params, eos_id, index);
            }
            auto n = static_cast<py::ssize_t>(t.tokens.size());
            py::dict out;
            out["tokens"] = to_numpy(std::move(t.tokens), {n});
            out["parents"] = to_numpy(std::move(t.parents), {n});
            out["positions"] = to_numpy(std::move(t.positions), {n});
            out["scores"] = to_numpy(std::move(t.scores), {n});
            out["sources"] = to_numpy(std::move(t.sources), {n});
            if (layouts) {
                out["mask"] = to_numpy(std::move(t.mask), {n, n}).attr("astype")("bool");
                out["retrieve"] =
                    to_numpy(std::move(t.retrieve), {static_cast<py::ssize_t>(t.n_leaves), static_cast<py::ssize_t>(t.width)});
            }
            return out;
        },
        py::arg("tokens"), py::arg("probs"), py::arg("root"), py::arg("context"), py::arg("model"), py::arg("params"),
        py::arg("eos_id"), py::arg("index") = nullptr, py::arg("layouts") = true,
        "PrunedTree's arrays by name; layouts=False: the nodes' alone (prune_nodes: no mask, no retrieve)");

    m.def(
        "ancestor_paths",
        [](const carray<int64_t>& parents, py::array_t<int32_t, py::array::c_style> paths, py::array_t<int32_t, py::array::c_style> lengths) {
            if (parents.ndim() != 1 || paths.ndim() != 2 || lengths.ndim() != 1)
                throw std::invalid_argument("ancestor_paths: parents (n,), paths (rows, width) and lengths (rows,) int32");
            const int64_t n = parents.shape(0);
            if (paths.shape(0) < n || lengths.shape(0) < n)
                throw std::invalid_argument("ancestor_paths: " + std::to_string(n) + " nodes need as many rows of paths and lengths");
            ancestor_paths(parents.data(), n, paths.shape(1), paths.mutable_data(), lengths.mutable_data());
        },
        py::arg("parents"), py::arg("paths"), py::arg("lengths"),
        "Fill paths[i] with node i's path from its root (root first, i last, then zeros) and lengths[i] with its length");
}
