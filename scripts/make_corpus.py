"""Generate the self-distilled corpus: the target's own answers to a pool of chat prompts, with its
hidden states captured in the generating forward (a training cache), resumably.

    python scripts/make_corpus.py --data ../shared/data/train/*.json* \\
        --exclude ../shared/data/bench/*.jsonl --out ~/.cache/dart-demo/runs/corpus-v1

Re-running the same command resumes. `--export DIR` writes the compact corpus (token ids, offsets,
provenance) that is committed under assets/corpus/; see dart_core/corpus.py.
"""

from __future__ import annotations

import sys

from dart_core.cli.corpus import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
