"""dart-gpu-check: where the engine stands on a CUDA GPU, in one command.

    dart-gpu-check --out DIR                       # env, exact, sampling and big on cuda (minutes)
    dart-gpu-check --out DIR --stages embedded     # the embedded model end to end
    python -m dart_core.cuda.check --out DIR ...   # the same, from a checkout that is not installed
    dart-gpu-check --targets DIR/gpu_check.json    # the targets a run met, as a table

Stages (--stages, comma-separated), each writing DIR/gpu_check.json (every result so far) and appending
to DIR/gpu_check.log as soon as it ends, so a run cut short keeps what it measured:

  env       the device, torch, Triton, and the memory bandwidth a large copy measures (the HBM limit)
  exact     tiny random Llama / Qwen2 / Qwen3 targets x bf16 / fp16 / fp32 with random DART and EAGLE3
            heads: greedy ids of dart and eagle3 against plain decoding, and every node of random
            trees verified in one forward against the one-token steps along its path (bitwise)
  sampling  the one-step chi-square test of speculative sampling on the GPU's logits (needs scipy)
  big       a random-weight target of Qwen3-8B's shape in bf16: the one-row step against the HBM limit,
            the verify's cost by rows at 512 and 4096 cached tokens, verify == steps at that size,
            DART draft + prune against EAGLE3's rollout at 60 nodes, the loop's stage costs a step, the
            host-device synchronizations a step makes, each linear's GEMM by backend, and a sweep of
            forward paths ranked (--big-parts chooses among them)
  profile   where the fixed-shape forward's time goes at the 8B shape: the graph replay against a whole
            verify, and the GPU time by kernel of one uncaptured forward at 1 and 64 rows
  embedded  the embedded model (its converted checkpoint or GGUF on the machine; see --model): ids,
            tau and tokens/s of ar, dart and eagle3, then its own sweep of forward paths

Forward paths (--paths, --sweep, --embedded-sweep) name how the target's forward runs: fixed is the
engine as it runs on the device; the others are listed under --paths. On CUDA each piece (a stage;
the exact stage and the big stage's verify a path at a time; the big stage's drafting and loop) runs
in a process of its own (--isolate): a kernel that fails, or loses the CUDA context, costs its piece,
and everything else still runs and is merged into the one report. It measures the engine as it is;
nothing here changes how the engine runs. It runs on a CPU too (--device cpu --small: the same code
at toy sizes, which is how it is tested without a GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from ..config import NO_TRITON, PATH_HELP, PATHS, known_path, valid_split
from . import big, embedded, env, exact, profile, sampling
from .common import ROOT, STAGES, Report, cuda_alive, has_failure
from .isolate import run_isolated
from .parts import DEVICE_CHECK_ARGS, write_parts
from .report import report_stages, targets, targets_table, triton_note

RUN = {
    "env": env.stage_env,
    "exact": exact.stage_exact,
    "sampling": sampling.stage_sampling,
    "big": big.stage_big,
    "profile": profile.stage_profile,
    "embedded": embedded.stage_embedded,
}

# The big stage's sweep (--sweep): the one-row step and the verify by rows at smaller splits than the
# default's 512 keys, a program a row and 16 rows a program, timed in one process
SWEEP = (
    "fixed-split-64,fixed-split-128,fixed-split-256,fixed-grouped-16-split-64,fixed-grouped-16-split-128,fixed-grouped-16-split-256,"
    "fixed-gemm,fixed-gemm-k2"
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dart-gpu-check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="folder for gpu_check.json and gpu_check.log (required but with --parts or --targets)")
    p.add_argument(
        "--parts",
        metavar="DIR",
        help="run no stage: for a machine without network access whose commands carry at most 64 MiB: write the embedded "
        "model in parts to DIR (git-ignored, e.g. device_parts) and print the commands that carry it there and run the "
        "embedded stage",
    )
    p.add_argument(
        "--parts-stage-args", default="--max-new-tokens 64 --embedded-dtypes bfloat16", help="--parts: the embedded stage's options"
    )
    p.add_argument("--parts-check-args", default=DEVICE_CHECK_ARGS, help="--parts: the check's options there (run while the parts travel)")
    p.add_argument("--parts-bench-sets", type=Path, default=None, help="--parts: a folder of dart-bench's *.jsonl sets, 2 prompts of each")
    p.add_argument(
        "--parts-scratch", default="/tmp", help="--parts: the remote machine's folder for the checkout's copy, the parts and the check"
    )
    p.add_argument(
        "--targets",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="run no stage: print the GPU targets (docs/gpu.md) as these reports measured them (gpu_check.json files, "
        "or a file under docs/results; later files' stages first)",
    )
    p.add_argument(
        "--stages", default="env,exact,sampling,big", help=f"comma-separated, from {', '.join(STAGES)} (default: env,exact,sampling,big)"
    )
    p.add_argument("--device", default="cuda", help="the torch device (default cuda; cpu with --small: the toy run the tests make)")
    p.add_argument("--small", action="store_true", help="toy sizes for the big stage and the bandwidth test (a CPU run)")
    p.add_argument("--model", default="default", help="embedded stage: the target (default: the embedded model)")
    p.add_argument("--heads", type=Path, default=ROOT / "assets", help="embedded stage: folder with dart/, eagle3/, ngram/")
    p.add_argument("--prompts", type=Path, default=None, help="embedded stage: a JSONL file, a prompt (string or chat messages) a line")
    p.add_argument("--embedded-dtypes", default="bfloat16,float32", help="embedded stage: the target's dtypes, comma-separated")
    p.add_argument("--nodes", type=int, default=60, help="embedded stage: drafted nodes a tree (DART and EAGLE3)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="embedded stage: tokens a prompt")
    p.add_argument(
        "--profile-drafters",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="embedded stage: profile one more generation of each drafter on a new prompt (top host and device ops; default on)",
    )
    p.add_argument(
        "--calibrate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="embedded stage: also calibrate the tree sizes on this device and run DART and EAGLE3 at them (default on)",
    )
    p.add_argument(
        "--paths",
        default="fixed,fixed-gemm,fixed-grouped-16,eager",
        help=f"exact and big stages: the target's forward paths, comma-separated, from {', '.join(PATHS)}, fixed-grouped-N "
        f"or fixed-gemm-kP. {PATH_HELP}. Default: the engine as it runs, the same with our GEMMs, 16 rows a program, plain torch",
    )
    p.add_argument("--fixed-rows", type=int, default=0, help="the fixed path's rows (default: the engine's for the device)")
    p.add_argument(
        "--fixed-split",
        type=int,
        default=0,
        help="keys an attention program of the fixed path reads, in every stage and path without its own -split-S "
        "(a multiple of 64; default: the engine's, 512)",
    )
    p.add_argument(
        "--embedded-sweep",
        default="fixed-split-64,fixed-split-128,fixed-split-256,fixed-gemm",
        help="embedded stage: forward paths whose verify by rows is timed (at --contexts) and checked bitwise beside the "
        "engine's, after the generations (default: 64-, 128- and 256-key splits, and our GEMMs; empty: none)",
    )
    p.add_argument(
        "--sweep",
        default=SWEEP,
        help="big stage (its sweep part): forward paths timed and checked bitwise in one process, ranked beside fixed "
        "by the one-row step and the 64-row verify (default: 64-, 128- and 256-key splits, a program a row and 16 rows a "
        "program, and fixed-gemm; empty: none)",
    )
    p.add_argument(
        "--contexts",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[512, 4096],
        help="big and profile stages: cached tokens the verify is timed at, comma-separated (default 512,4096)",
    )
    p.add_argument("--exact-tokens", type=int, default=40, help="exact stage: greedy tokens a prompt (0: the verify checks only)")
    p.add_argument(
        "--big-parts",
        default="verify,sweep,gemm,drafting",
        help="big stage: verify (each path's cost by rows, verify == steps), sweep (the same for --sweep's paths, ranked), "
        "gemm (each linear's GEMM at the fixed rows by backend: torch, cuBLASLt, our Triton GEMM; bitwise by row place), "
        "drafting (drafting at 60 nodes and the loop a step)",
    )
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each piece (a stage, or a stage's forward path) in a process of its own, so a lost CUDA context or a crash "
        "costs that piece only (default: on CUDA)",
    )
    p.add_argument("--piece-timeout", type=float, default=300, help="--isolate: seconds a piece may run (default 300)")
    p.add_argument("--read-gb-s", type=float, default=None, help="big stage: the read bandwidth for the HBM limit (default: env's)")
    argv = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(argv)
    if a.targets:
        stages: dict = {}
        for path in a.targets:
            stages.update(report_stages(json.loads(path.read_text())))
        print(targets_table(targets(stages)))
        print(f"\n{triton_note(stages)}")
        return 0
    if a.parts:
        write_parts(a.parts, a.parts_stage_args, check_args=a.parts_check_args, scratch=a.parts_scratch, sets=a.parts_bench_sets)
        return 0
    if a.out is None:
        p.error("--out is required (but with --parts or --targets)")
    stages = [s for s in a.stages.split(",") if s]
    if not all(known_path(x) for x in a.paths.split(",")):
        p.error(
            f"--paths: from {', '.join(PATHS)} or fixed-grouped-N or fixed-gemm-kP, each maybe with -split-S "
            f"(S a multiple of 64), got {a.paths!r}"
        )
    for name, value in (("--sweep", a.sweep), ("--embedded-sweep", a.embedded_sweep)):
        if not all(known_path(x) and x not in NO_TRITON for x in value.split(",") if x):
            p.error(f"{name}: paths on the Triton attention (as --paths, not eager or fixed-torch), got {value!r}")
    if a.fixed_split and not valid_split(a.fixed_split):
        p.error(f"--fixed-split: a multiple of 64 keys, got {a.fixed_split}")
    unknown = set(stages) - set(STAGES)
    if unknown:
        p.error(f"unknown stages {sorted(unknown)}: choose from {', '.join(STAGES)}")
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available (use --device cpu --small for a CPU run)")
    if set(a.big_parts.split(",")) - {"verify", "sweep", "gemm", "drafting"}:
        p.error(f"--big-parts: from verify, sweep, gemm, drafting, got {a.big_parts!r}")
    rep = Report(a.out)
    rep.data["argv"] = sys.argv
    if a.isolate if a.isolate is not None else dev.type == "cuda":
        return run_isolated(a, argv, stages, rep)
    failed = 0
    for stage in stages:
        t0 = time.perf_counter()
        rep.log(f"--- {stage}")
        try:
            if stage in ("embedded", "exact", "big", "profile"):
                result = RUN[stage](dev, a.small, rep, a)
            else:
                result = RUN[stage](dev, a.small, rep)
            result["seconds"] = round(time.perf_counter() - t0, 1)
        except Exception as e:  # a stage's failure is recorded; the next stages still run
            result = {**rep.data["stages"].get(stage, {}), "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            rep.log(f"{stage} FAILED: {result['traceback']}")
        failed += has_failure(result)
        rep.save(stage, result)
        if not cuda_alive(dev):
            rep.log(f"the CUDA context is lost: the stages after {stage} cannot run in this process (--isolate runs each in its own)")
            break
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    rep.log(f"done: {len(stages) - failed}/{len(stages)} stages ran without a failure")
    return 1 if failed else 0
