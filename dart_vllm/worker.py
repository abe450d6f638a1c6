"""One vLLM engine serving the bench's prompts, run by the vLLM venv's python (dart_core/tools/vllm_peer.py
starts it): `python -c "from dart_vllm.worker import main; main()" --model DIR [--draft HEAD --method dart|eagle3 --k N]`.

It loads vLLM's offline engine once, prints one JSON line {"ready": ...}, then answers each JSON line
on stdin ({"ids", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_ids", "top2_gaps"}) with one
JSON line on stdout: the output ids and text, vLLM's own timestamps (prefill = first token - scheduled, decode =
last token - first token, as its request metrics define them), the wall time of the generate call,
the request's speculative-decoding counters and, where the request asks ("top2_gaps": true), the gap
between the top two logprobs of each new token (= the gap between its top two logits: log-softmax
subtracts one number from every logit; vLLM's raw logprobs, before any sampling setting). vLLM's log
goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

KV_CACHE_BYTES = 512 << 20  # one bench request at a time: 512 MiB of KV cache is plenty (vLLM's CPU default reserves 92% of RAM)


def build_llm(args):
    from vllm import LLM

    spec = None
    if args.method == "dart":
        import dart_vllm

        spec = dart_vllm.speculative_config(args.draft, args.k)
    elif args.method == "eagle3":
        spec = {"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.k}
    return LLM(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        speculative_config=spec,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        per_request_spec_decode_metrics="summary" if spec else "none",
        disable_log_stats=False,
        seed=0,
        # the engine in this process (with VLLM_ENABLE_V1_MULTIPROCESSING=0, which VllmPeer sets): a start
        # of ~22 s instead of ~52 s on 2 cores, the same generation speed; `vllm serve` keeps its processes
        distributed_executor_backend="uni",
    )


def answer(llm, req: dict) -> dict:
    from vllm import SamplingParams, TokensPrompt

    greedy = req.get("temperature", 0.0) == 0.0
    sp = SamplingParams(
        max_tokens=int(req["max_new_tokens"]),
        temperature=0.0 if greedy else float(req["temperature"]),
        top_p=1.0 if greedy else float(req.get("top_p", 1.0)),
        top_k=0 if greedy else int(req.get("top_k", 0) or 0),
        seed=req.get("seed"),
        stop_token_ids=list(req.get("stop_ids", [])),
        logprobs=2 if req.get("top2_gaps") else None,
    )
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=list(req["ids"]))], sp, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    c = out.outputs[0]
    m = out.metrics
    spec = c.spec_decode_metrics.to_dict() if getattr(c, "spec_decode_metrics", None) is not None else None
    gaps = None
    if req.get("top2_gaps"):
        gaps = []
        for step in c.logprobs or []:
            top = sorted((lp.logprob for lp in step.values()), reverse=True)
            gaps.append(top[0] - top[1] if len(top) > 1 else None)
    return {
        "ids": list(c.token_ids),
        "text": c.text,
        "top2_gaps": gaps,
        "finish_reason": c.finish_reason,
        "prefill_s": m.first_token_ts - m.scheduled_ts if m is not None else None,
        "decode_s": m.last_token_ts - m.first_token_ts if m is not None else None,
        "wall_s": wall,
        "spec": spec,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="dart_vllm.worker")
    ap.add_argument("--model", required=True, help="the target's safetensors directory")
    ap.add_argument("--method", choices=("plain", "eagle3", "dart"), default="plain")
    ap.add_argument("--draft", help="the draft head's directory (eagle3, dart)")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step (num_speculative_tokens)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.method != "plain" and not args.draft:
        ap.error(f"--method {args.method} needs --draft")
    # Only the protocol's lines go to the real stdout: vLLM, its engine processes (which inherit the
    # file descriptors) and native code print, so fd 1 becomes stderr and the protocol keeps a copy.
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    t0 = time.perf_counter()
    try:
        llm = build_llm(args)
    except Exception as e:  # the caller shows the reason and the log
        out.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        raise SystemExit(1) from e
    import vllm

    out.write(json.dumps({"ready": True, "load_s": time.perf_counter() - t0, "vllm": vllm.__version__, "pid": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = answer(llm, json.loads(line))
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
