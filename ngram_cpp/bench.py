"""Micro-benchmark of the n-gram trie and the pruner on the embedded default's trie.

    python -m ngram_cpp.bench --json

Prints one JSON line: query_us (one (context, token) lookup), query25_us (one context, 25 tokens),
prune_ms (d=8, k=25, beam 20, 60 nodes, peaked random draft probabilities), load_ms per format,
rss_mb after loading. Contexts and candidates are drawn from the trie's own level-1 tokens.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import ngram_cpp

DEFAULT_TRIE = Path(__file__).resolve().parent.parent / "assets" / "ngram" / "smollm2-3gram.ngram"
DRAFT_DEPTH, TOP_K = 8, 25
LOGIT_SCALE = 3.0  # gaussian logits * this, softmaxed over the top-k: peaked like a trained head's


def _timeit(fn, repeat: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run(trie: Path, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    model = ngram_cpp.load(trie)
    load_compact_ms = 1000 * (time.perf_counter() - t0)
    rss = _rss_mb()
    with tempfile.TemporaryDirectory() as tmp:
        upstream = Path(tmp) / "model.trie"
        model.save(upstream, "upstream")
        t0 = time.perf_counter()
        ngram_cpp.load(upstream)
        load_upstream_ms = 1000 * (time.perf_counter() - t0)

    vocab = model.vocab_size
    frequent = rng.integers(0, vocab, size=4096)
    contexts = [frequent[rng.integers(0, len(frequent), 2)] for _ in range(256)]
    native = model.native
    i = iter(range(10**9))

    def one():
        c = contexts[next(i) % len(contexts)]
        native.prob(c, int(c[0])) if native is not None else model.prob(c, int(c[0]))

    cands = rng.integers(0, vocab, size=TOP_K)

    def twenty_five():
        c = contexts[next(i) % len(contexts)]
        model.probs(c, cands)

    tokens = np.stack([rng.choice(vocab, TOP_K, replace=False) for _ in range(DRAFT_DEPTH)])
    logits = rng.standard_normal((DRAFT_DEPTH, TOP_K)) * LOGIT_SCALE
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs = (probs / probs.sum(1, keepdims=True)).astype(np.float32)
    params = ngram_cpp.PruneParams(top_k=TOP_K, beam_width=20, max_nodes=60)
    context = frequent[:16]

    def prune():
        ngram_cpp.prune(tokens, probs, int(frequent[0]), context, model, params, eos_id=-1)

    return {
        "cpp": ngram_cpp.HAVE_CPP,
        "trie": str(trie),
        "nodes": model.num_nodes,
        "query_us": 1e6 * _timeit(one, 20000),
        "query25_us": 1e6 * _timeit(twenty_five, 5000),
        "prune_ms": 1e3 * _timeit(prune, 300),
        "load_ms": {"compact": load_compact_ms, "upstream": load_upstream_ms},
        "rss_mb": rss,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ngram_cpp.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--trie", type=Path, default=DEFAULT_TRIE)
    p.add_argument("--json", action="store_true", help="print one JSON line (otherwise a readable summary)")
    args = p.parse_args(argv)
    result = run(args.trie)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>12}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
