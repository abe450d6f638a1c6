"""Start the demo:  python -m app  (the embedded default model, http://127.0.0.1:7860).

Flag names follow the upstream DART app where it has them (facts doc §7).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

import ngram_cpp
from dart_core import GenerationParams, load_target
from dart_core.bench import DEFAULT_MAX_NODES
from dart_core.loading import DEFAULT_MODEL

from .engine import Engine
from .ui import CSS, Settings, build_demo

log = logging.getLogger("app")
ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_DART = ASSETS / "dart"
DEFAULT_NGRAM = ASSETS / "ngram" / "smollm2-3gram.ngram"
DEFAULT_PORT = 7860
WARMUP_PROMPTS = ("Hello!", "Say hi in one short sentence.")
WARMUP_TOKENS = 8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m app", description="DART speculative decoding demo (Gradio).")
    p.add_argument("--base-model-name-or-path", default=DEFAULT_MODEL, help="target: 'default' (embedded SmolLM2-135M-Instruct), a local dir or a hub id")
    p.add_argument("--dart-model-name-or-path", default=str(DEFAULT_DART), help="DART head dir or hub id (default: the embedded head)")
    p.add_argument("--ngram-model-name-or-path", default=None, help="n-gram file, or a directory holding full.trie/small.trie or one *.ngram (default: the embedded trie for the default model)")
    p.add_argument("--use-small-ngram", action="store_true", help="with a directory, load small.trie instead of full.trie")
    p.add_argument("--no-ngram", action="store_true", help="prune draft trees without the n-gram model")
    p.add_argument("--template-name", default=None, help="accepted for upstream compatibility; the tokenizer's own chat template is always used")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-length", type=int, default=2048, help="prompt + output limit (tokens)")
    p.add_argument("--compare-eagle3", action="store_true", help="compare mode: run every loaded method on each prompt, one after another")
    p.add_argument("--eagle3-model-name-or-path", default=None, help="EAGLE3 head (not available in this version)")
    p.add_argument("--tree-top-k", type=int, default=25)
    p.add_argument("--beam-width", type=int, default=20)
    p.add_argument("--max-nodes", type=int, default=None, help=f"draft tree nodes besides the root (default per device: {DEFAULT_MAX_NODES})")
    p.add_argument("--listen", action="store_true", help="bind 0.0.0.0 instead of 127.0.0.1")
    p.add_argument("--share", action="store_true", help="ask Gradio for a public link")
    p.add_argument("--server-port", type=int, default=DEFAULT_PORT)
    p.add_argument("--no-warmup", action="store_true")
    return p.parse_args(argv)


def resolve_ngram(args) -> Path | None:
    if args.no_ngram:
        return None
    if args.ngram_model_name_or_path is None:
        return DEFAULT_NGRAM if args.base_model_name_or_path == DEFAULT_MODEL and DEFAULT_NGRAM.exists() else None
    path = Path(args.ngram_model_name_or_path)
    if path.is_dir():
        name = "small.trie" if args.use_small_ngram else "full.trie"
        candidates = [path / name] + sorted(path.glob("*.ngram"))
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise SystemExit(f"no {name} or *.ngram in {path}")
        return found
    if not path.is_file():
        raise SystemExit(f"no n-gram file at {path}")
    return path


def load_engine(args) -> tuple[Engine, list[str]]:
    notes = []
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    log.warning("loading target %s (%s, %s)…", args.base_model_name_or_path, device, args.dtype)
    target = load_target(args.base_model_name_or_path, device, args.dtype)
    drafters = {}
    default_head_missing = Path(args.dart_model_name_or_path) == DEFAULT_DART and not DEFAULT_DART.exists()
    if not default_head_missing:
        from dart_core.drafters.dart import DartParams, load_dart_drafter

        ngram = resolve_ngram(args)
        log.warning("loading DART head %s and n-gram %s…", args.dart_model_name_or_path, ngram)
        max_nodes = args.max_nodes if args.max_nodes is not None else DEFAULT_MAX_NODES.get(target.device.type, 60)
        params = DartParams(ngram_cpp.PruneParams(top_k=args.tree_top_k, beam_width=args.beam_width, max_nodes=max_nodes, use_ngram=ngram is not None))
        drafters["dart"] = load_dart_drafter(args.dart_model_name_or_path, target, ngram, params)
        if ngram is None:
            notes.append("DART runs without an n-gram model.")
    else:
        notes.append(f"No DART head at {DEFAULT_DART}: only plain decoding (AR) is available.")
    if args.compare_eagle3 or args.eagle3_model_name_or_path:
        notes.append("The EAGLE3 baseline is not part of this version yet; compare mode shows DART against plain decoding.")
    if args.template_name:
        notes.append(f"--template-name {args.template_name} ignored: the tokenizer's own chat template is used.")
    if not ngram_cpp.HAVE_CPP:
        notes.append("The C++ pruner is not built here: the pure-Python pruner runs (slower drafting).")
    for n in notes:
        log.warning(n)
    return Engine(target, drafters), notes


def warm_up(engine: Engine) -> None:
    """First calls pay for lazy initialisation; do them before users arrive. The AR run also gives the
    reference speed that speed-ups are quoted against."""
    for method in engine.methods:
        for prompt in WARMUP_PROMPTS:
            for _ in engine.stream([{"role": "user", "content": prompt}], method, GenerationParams(WARMUP_TOKENS)):
                pass
    log.warning("warm-up done (AR %.1f tok/s)", engine.ar_tokens_per_s or 0.0)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    engine, notes = load_engine(args)
    if not args.no_warmup:
        warm_up(engine)
    settings = Settings(
        max_new_tokens=args.max_new_tokens,
        max_length=args.max_length,
        compare=args.compare_eagle3,
        pruner="C++" if ngram_cpp.HAVE_CPP else "pure Python",
        notes=tuple(notes),
    )
    demo = build_demo(engine, settings)
    demo.queue(default_concurrency_limit=1)
    demo.launch(
        server_name="0.0.0.0" if args.listen else "127.0.0.1",
        server_port=args.server_port,
        share=args.share,
        css=CSS,
        show_error=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
