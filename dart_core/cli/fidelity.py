"""What a weights path changes against the fp32 copy: teacher-forced top-1 agreement on held-out prompts.

    dart-fidelity --paths gguf-int8,bfloat16,gguf --dataset ../shared/data/bench/*.jsonl \\
        --skip 10 --limit 10 --max-new-tokens 128

For each prompt (the first turn of questions skip+1 .. skip+limit of each set: held out from the
bench's first ten), the fp32 copy writes its greedy continuation; each path then reads the same text
and we count the positions where it would pick the same next token (dart_core/tools/fidelity.py), the
largest relative logit error, and where its own greedy text parts from the reference's.

--float-inputs asks where gguf-int8's 8-bit activations cost agreement: each SPEC (linears joined by
"+", from wqkv, wo, w13, w2, head) adds a gguf-int8 path whose named linears keep fp32 inputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from .. import kernels
from ..generate import ARDrafter, GenerationParams, complete
from ..gguf_checkpoint import FLOAT_INPUT_LINEARS
from ..loading import DTYPE_CHOICES, GGUF_INT8
from ..target import FLOAT_INPUTS_MARK, load_target, weights_spec
from ..tools.bench import held_out_questions
from ..tools.fidelity import first_divergence, teacher_forced_agreement


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paths", default="gguf-int8,bfloat16", help=f"comma-separated weights paths to compare ({', '.join(DTYPE_CHOICES)})")
    p.add_argument("--reference", default="float32", choices=DTYPE_CHOICES, help="the path every other is compared with")
    p.add_argument("--dataset", nargs="+", type=Path, required=True, help="question.jsonl files (the bench's format)")
    p.add_argument("--skip", type=int, default=10, help="questions of each set skipped first (the bench uses the first 10)")
    p.add_argument("--limit", type=int, default=10, help="questions per set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--float-inputs",
        nargs="+",
        default=[],
        metavar="SPEC",
        help=f"extra gguf-int8 paths, each with these linears' inputs in fp32 (e.g. w2 wqkv+w13; from {', '.join(FLOAT_INPUT_LINEARS)})",
    )
    p.add_argument("--out", type=Path, help="write the per-prompt results as JSON")
    a = p.parse_args(argv)
    paths = [s.strip() for s in a.paths.split(",") if s.strip()]
    bad = [s for s in paths if s not in DTYPE_CHOICES]
    if bad or a.max_new_tokens < 1 or a.limit < 1 or a.skip < 0:
        p.error(f"unknown path(s) {bad}" if bad else "--max-new-tokens and --limit must be >= 1, --skip >= 0")
    try:  # target.weights_spec checks the linears' names
        specs = {name: weights_spec(name) for name in (GGUF_INT8 + FLOAT_INPUTS_MARK + spec for spec in a.float_inputs)}
    except ValueError as e:
        p.error(f"--float-inputs: {e}")
    questions = held_out_questions(a.dataset, a.skip, a.limit)
    reference = load_target("default", "cpu", a.reference)
    tests = {name: load_target("default", "cpu", name) for name in paths}
    for name, (dtype, float_inputs) in specs.items():
        tests[name] = load_target("default", "cpu", dtype, float_inputs=float_inputs)
        paths.append(name)
    print(f"# {kernels.describe()}; reference {reference.weights}; {len(questions)} prompts x {a.max_new_tokens} tokens", file=sys.stderr)
    rows = []
    for i, (dataset, q) in enumerate(questions):
        ids = reference.encode(q["turns"][0])
        ref_out = complete(reference, ids, ARDrafter(), GenerationParams(a.max_new_tokens)).output_ids
        row = {"dataset": dataset, "question_id": q.get("question_id"), "tokens": len(ref_out)}
        for name, t in tests.items():
            agree = teacher_forced_agreement(reference, t, ids, ref_out)
            own = complete(t, ids, ARDrafter(), GenerationParams(a.max_new_tokens)).output_ids
            row[name] = {
                "top1": agree.top1,
                "disagreements": round((1 - agree.top1) * agree.positions),
                "max_rel_logit_error": agree.max_rel_logit_error,
                "greedy_parts_at": first_divergence(own, ref_out),
            }
        rows.append(row)
        print(f"[{i + 1}/{len(questions)}] {dataset} " + "  ".join(f"{n}: {row[n]['top1']:.3f}" for n in paths), file=sys.stderr)
    total = sum(r["tokens"] for r in rows)
    print("| path | top-1 agreement | positions | max rel. logit error (median over prompts) | greedy texts identical |")
    print("|---|---|---|---|---|")
    for name in paths:
        dis = sum(r[name]["disagreements"] for r in rows)
        same = sum(r[name]["greedy_parts_at"] is None for r in rows)
        med = statistics.median(r[name]["max_rel_logit_error"] for r in rows)
        print(f"| {tests[name].weights} | {1 - dis / total:.4f} | {total} | {med:.2e} | {same}/{len(rows)} |")
    if a.out:
        a.out.write_text(json.dumps({"reference": reference.weights, "kernels": kernels.describe(), "rows": rows}, indent=1))
    return 0
