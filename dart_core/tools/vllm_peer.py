"""vLLM as a peer of the bench: the same prompt ids and greedy or sampling settings, run by vLLM's own
engine (vLLM's CPU build here) in the venv `make vllm` builds, one engine process per method.

    peer = VllmPeer("vllm-dart@3", model_dir=target.model_dir, eos_ids=target.eos_ids, threads=2)
    r = peer.generate(prompt_ids, max_new_tokens=128)   # a VllmRun
    peer.close()

Methods (VLLM_METHODS; `@N` sets num_speculative_tokens, default DEFAULT_DRAFT):
  vllm          vLLM's plain decoding
  vllm-eagle3   vLLM's `eagle3` method with our EAGLE3 head (assets/eagle3), unchanged
  vllm-dart     our DART head through this project's vLLM plugin (dart_vllm: one parallel draft
                forward, DART's pruner choosing the chain vLLM verifies)
vLLM reads safetensors, not GGUF, on the CPU: the target is the embedded model's converted checkpoint
(its GGUF weights dequantized), in float32 unless the target says bfloat16 (VllmPeer's dtype).

Timing, as vLLM's request metrics report it (the engine's own timestamps): prefill = first token -
scheduled, decode = last token - first token; end-to-end tokens/s = new tokens / (prefill + decode),
decode-only = (new tokens - 1) / decode, as the bench measures ours and llama.cpp's. The wall time of
the generate call (its process hop included) is kept beside them. τ and accepted/drafted come from
vLLM's per-request speculative-decoding counters. vLLM returns token ids, so its output is compared
with ours id for id (no re-tokenization).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dart_vllm.env import VLLM_VERSION, EnvError, probe, ready, venv_python  # noqa: F401  (VLLM_VERSION, venv_python: the bench records them)

VLLM_METHODS = ("vllm", "vllm-eagle3", "vllm-dart")
DEFAULT_DRAFT = 3  # draft tokens a step where the name has no @N


class VllmError(RuntimeError):
    pass


def split_vllm_method(name: str) -> tuple[str, int | None]:
    """'vllm-dart@4' -> ('vllm-dart', 4); 'vllm' takes no @N."""
    base, at, n = name.partition("@")
    if base not in VLLM_METHODS:
        raise ValueError(f"unknown vLLM method {base!r}: choose from {', '.join(VLLM_METHODS)}")
    if not at:
        return base, None
    if base == "vllm":
        raise ValueError(f"{name!r}: plain vLLM decoding takes no draft length")
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"{name!r}: the draft length after @ must be a positive integer")
    return base, int(n)


def unavailable() -> str | None:
    """Why the vLLM methods cannot run here (None: they can), without building anything."""
    try:
        why = ready(probe(venv_python()))
    except EnvError as e:
        why = str(e)
    return None if why is None else f"the vLLM venv is not ready ({why}): run `make vllm`"


@dataclass
class VllmRun:
    """One prompt through one vLLM method."""

    output_ids: list[int]
    text: str  # as vLLM decoded it (special tokens skipped)
    stop: str  # "eos" | "length"
    prefill_s: float
    decode_s: float
    call_s: float  # the generate call's wall time in the worker
    drafted: int | None
    accepted: int | None
    steps: int | None  # verify steps vLLM counted (speculative methods)
    top2_gaps: list[float] | None = None  # plain decoding: each new token's top-2 logit gap (vLLM's logprobs)

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def target_forwards(self) -> int:
        """The prefill (the first token) and one forward per later step."""
        return 1 + self.steps if self.steps is not None else self.new_tokens


class VllmPeer:
    """One vLLM engine (a worker process in the vLLM venv) for one method."""

    def __init__(
        self,
        name: str,
        model_dir: str | os.PathLike,
        eos_ids,
        threads: int,
        dtype: str = "float32",
        dart_head: str | os.PathLike | None = None,
        eagle3_head: str | os.PathLike | None = None,
        max_model_len: int = 4096,
        timeout_s: float | None = None,
    ):
        from ..drafters import DEFAULT_DART_HEAD, DEFAULT_EAGLE3_HEAD

        base, k = split_vllm_method(name)
        self.name, self.eos_ids = name, sorted(int(e) for e in eos_ids)
        self.k = None if base == "vllm" else (k or DEFAULT_DRAFT)
        self.dtype, self.threads, self.timeout_s = dtype, threads, timeout_s
        cmd = [
            str(venv_python()),
            "-P",  # the plugin from the checkout the venv names (make vllm), whatever the current directory
            "-c",
            "from dart_vllm.worker import main; main()",
            "--model",
            str(model_dir),
            "--dtype",
            dtype,
            "--max-model-len",
            str(max_model_len),
        ]
        if base != "vllm":
            method = base.removeprefix("vllm-")
            head = (dart_head or DEFAULT_DART_HEAD) if method == "dart" else (eagle3_head or DEFAULT_EAGLE3_HEAD)
            cmd += ["--method", method, "--draft", str(head), "--k", str(self.k)]
        env = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(threads, 1) - 1}",
            "OMP_NUM_THREADS": str(threads),
            "VLLM_LOGGING_LEVEL": "WARNING",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine inside the worker (dart_vllm/worker.py)
        }
        env.pop("PYTHONPATH", None)  # the vLLM venv has its own packages; the checkout comes through its .pth
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"dart-{base}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, bufsize=1)
        hello = self._read(timeout_s=None)  # the engine's start: tens of seconds, bounded by vLLM's own errors
        if not hello.get("ready"):
            self.close()
            raise VllmError(f"{name}: vLLM did not start: {hello.get('error', 'no reason given')} (log: {self.log.name})")
        self.load_s, self.version = hello["load_s"], hello["vllm"]

    def _read(self, timeout_s: float | None) -> dict:
        if timeout_s is not None and not select.select([self.proc.stdout], [], [], timeout_s)[0]:
            self.proc.kill()  # a request vLLM did not answer in time: this engine is done (later calls say so)
            self.proc.wait()
            raise VllmError(f"{self.name}: no answer in {timeout_s:.0f} s; the vLLM worker was stopped (log: {self.log.name})")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise VllmError(f"{self.name}: the vLLM worker exited ({self.proc.returncode}); its log: {self.log.name}\n{self.log_tail()}")
        return json.loads(line)

    def log_tail(self, lines: int = 15) -> str:
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def generate(self, ids: list[int], max_new_tokens: int, sampling=None) -> VllmRun:
        req = {"ids": list(ids), "max_new_tokens": int(max_new_tokens), "stop_ids": self.eos_ids, "temperature": 0.0}
        if self.proc.poll() is not None:
            raise VllmError(f"{self.name}: the vLLM worker has exited ({self.proc.returncode}); its log: {self.log.name}")
        if self.k is None:  # plain decoding keeps its top-2 gaps: where a drafting method parts from it, was it a near-tie?
            req["top2_gaps"] = True
        if sampling is not None and not sampling.greedy:
            req.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or 0, seed=sampling.seed)
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        r = self._read(self.timeout_s)
        if "error" in r:
            raise VllmError(f"{self.name}: {r['error']}")
        spec = r.get("spec")
        return VllmRun(
            output_ids=r["ids"],
            text=r.get("text") or "",
            stop="eos" if r["ids"] and r["ids"][-1] in self.eos_ids else "length",
            prefill_s=r["prefill_s"],
            decode_s=r["decode_s"],
            call_s=r["wall_s"],
            drafted=None if spec is None else spec["num_draft_tokens"],
            accepted=None if spec is None else spec["num_accepted_draft_tokens"],
            steps=None if spec is None else spec["num_spec_steps"],
            top2_gaps=r.get("top2_gaps"),
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
