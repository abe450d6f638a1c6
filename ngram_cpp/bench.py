"""Micro-benchmark of the n-gram trie and the pruner on the embedded default's trie.

    dart-ngram-bench --json

Prints one JSON line:
    query_us        one (2-token context, token) lookup, timed inside C++ (the paper's 6 us figure is that)
    query25_us      one 2-token context and 25 candidate tokens, inside C++
    query_py_us     the same single lookup called from Python (NGram.prob; pybind11 and numpy overhead included)
    query25_py_us   the 25-token lookup from Python (NGram.probs)
    prune_ms        ngram_cpp.prune from Python: d=8, k=25, beam 20, 60 nodes, peaked draft probabilities
    prune_cpu_ms    the same in CPU time of the calling thread (what it costs on one core of a busy machine)
    load_ms         {"compact": mmap load, "upstream": parsing the same trie written as a .trie}
    rss_mb          resident memory of the process right after the compact load (Python + numpy included)
Lookups use real contexts: 2-token paths of the trie itself, with candidates among the most frequent
tokens, so most lookups find the context and walk the long child lists of common tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

import ngram_cpp

DEFAULT_TRIE = Path(__file__).resolve().parent.parent / "assets" / "ngram" / "smollm2-3gram.ngram.xz"
DRAFT_DEPTH, TOP_K, BEAM_WIDTH, MAX_NODES = 8, 25, 20, 60
LOGIT_SCALE = 3.0  # gaussian logits * this, softmaxed over the top-k: peaked like a trained head's
FREQUENT_TOKENS = 300  # candidates are drawn from this many most frequent tokens
N_CONTEXTS = 512


def _timeit(fn, repeat: int, clock=time.perf_counter) -> float:
    """Mean seconds per call (after one warm-up call)."""
    fn()
    t0 = clock()
    for _ in range(repeat):
        fn()
    return (clock() - t0) / repeat


def _rss_mb() -> float:
    """Current resident set size, from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _real_contexts(native, rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 2) int64: random 2-token paths of the trie (levels 1-2), weighted by their counts."""
    tok1, _, first_child = native.level_arrays(1)
    tok2, cnt2, _ = native.level_arrays(2)
    picks = rng.choice(len(tok2), size=n, p=cnt2 / cnt2.sum())
    parents = np.searchsorted(first_child, picks, side="right") - 1
    return np.stack([tok1[parents], tok2[picks]], axis=1).astype(np.int64)


def _frequent(native) -> np.ndarray:
    tok1, cnt1, _ = native.level_arrays(1)
    return tok1[np.argsort(-cnt1, kind="stable")[:FREQUENT_TOKENS]].astype(np.int64)


def _draft(rng: np.random.Generator, frequent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d, k) candidate tokens and their peaked, top-k-softmaxed draft probabilities."""
    tokens = np.stack([rng.choice(frequent, TOP_K, replace=False) for _ in range(DRAFT_DEPTH)])
    logits = rng.standard_normal((DRAFT_DEPTH, TOP_K)) * LOGIT_SCALE
    probs = np.exp(logits - logits.max(1, keepdims=True))
    return tokens, (probs / probs.sum(1, keepdims=True)).astype(np.float32)


def run(trie: Path, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    model = ngram_cpp.load(trie)
    load_compact_ms = 1000 * (time.perf_counter() - t0)
    rss = _rss_mb()
    native = model.native
    if native is None:
        raise SystemExit("the benchmark needs the C++ extension (ngram_cpp.HAVE_CPP is False)")
    with tempfile.TemporaryDirectory() as tmp:
        upstream = Path(tmp) / "model.trie"
        model.save(upstream, "upstream")
        t0 = time.perf_counter()
        ngram_cpp.load(upstream)
        load_upstream_ms = 1000 * (time.perf_counter() - t0)

    contexts = _real_contexts(native, rng, N_CONTEXTS)
    frequent = _frequent(native)
    singles = rng.choice(frequent, size=(N_CONTEXTS, 1))
    rows25 = np.stack([rng.choice(frequent, TOP_K, replace=False) for _ in range(N_CONTEXTS)])
    query_us = ngram_cpp._ngram.time_lookups(native, contexts, singles, 200)
    query25_us = ngram_cpp._ngram.time_lookups(native, contexts, rows25, 50)

    calls = iter(range(10**9))

    def one():
        i = next(calls) % N_CONTEXTS
        model.prob(contexts[i], int(singles[i, 0]))

    def twenty_five():
        i = next(calls) % N_CONTEXTS
        model.probs(contexts[i], rows25[i])

    drafts = [_draft(rng, frequent) for _ in range(16)]
    params = ngram_cpp.PruneParams(top_k=TOP_K, beam_width=BEAM_WIDTH, max_nodes=MAX_NODES)

    def prune():
        i = next(calls)
        tokens, probs = drafts[i % len(drafts)]
        ngram_cpp.prune(tokens, probs, int(contexts[i % N_CONTEXTS, 1]), contexts[(i + 1) % N_CONTEXTS], model, params, eos_id=-1)

    return {
        "cpp": ngram_cpp.HAVE_CPP,
        "trie": str(trie),
        "nodes": model.num_nodes,
        "query_us": query_us,
        "query25_us": query25_us,
        "query_py_us": 1e6 * _timeit(one, 20000),
        "query25_py_us": 1e6 * _timeit(twenty_five, 10000),
        "prune_ms": 1e3 * _timeit(prune, 500),
        "prune_cpu_ms": 1e3 * _timeit(prune, 500, time.thread_time),
        "load_ms": {"compact": load_compact_ms, "upstream": load_upstream_ms},
        "rss_mb": rss,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dart-ngram-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--trie", type=Path, default=DEFAULT_TRIE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line (otherwise a readable summary)")
    args = p.parse_args(argv)
    result = run(args.trie, args.seed)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>14}: {v}")
    return 0
