"""The app's engine: one loaded target, its drafters and a lock, consuming the one generation loop.

Chat, compare mode and the /generate API all go through `Engine.stream`, which drives
`dart_core.generate` and turns its events into a `Run` (the text so far, one `Step` per target
forward, timings). The target is CPU-bound and shared, so every step computes on the one
`ComputeThread`, one step at a time, whichever Gradio thread asks for it (a cancelled request whose
generator is never closed holds nothing between steps); Gradio's queue serialises whole requests
(concurrency limit 1). Every run decodes in a KV cache of its own from `generate`, so no request
ever writes another's state.

A conversation remembers (`Engine.prefix`, dart_core/prefix_cache.py): each run's context is kept in
a store bounded by bytes, scoped to its owner (the browser session that asked), and the next run of
that owner copies the longest prefix it shares into its own cache and prefills only the rest: a chat's
next turn prefills the new messages only, and compare mode prefills each prompt once, the other
methods decoding from copies of its rows. Only where that is exact (Target.prefill_exact): the engine
then runs long prompts in kernel forwards (model.kernel_prefill), so every row has its one-token
step's bits whichever run wrote it.

Speeds count engine time only: the seconds spent inside the generation loop (prefill included),
not the time the UI spends drawing between steps, nor time spent waiting in the queue.

Compare mode may end with peers, other engines on the same prompt ids (`Peer`): llama.cpp's own
binaries on the GGUF the target came from (dart_core/tools/peers.py), and vLLM's engine on its converted
checkpoint, plain or drafting with our heads through this project's plugin (dart_core/tools/vllm_peer.py,
`--compare-vllm`). A peer runs on the compute thread too, so it never shares the cores with an engine
step, and yields a `PeerResult`, a Run without steps whose time is the peer's own prefill + decode.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, TypeVar

from dart_core import ARDrafter, Drafter, DraftTree, GenerationParams, SamplingParams, StepEvent, Summary, generate, kernels
from dart_core.prefix_cache import PrefixScope, PrefixStore
from dart_core.target import Target
from dart_core.tools.methods import METHODS, is_vllm
from dart_core.tools.peers import PeerError, PeerRun, split_peer_method
from dart_core.tools.vllm_peer import VllmRun, split_vllm_method

METHOD_ORDER = ("dart", "eagle3", "ar")  # the methods the app runs (dart_core.tools.methods), in compare mode's order
PEER_TIMEOUT_S = 300.0  # a peer's run longer than this is killed and shown as failed (Stop cannot end it sooner)
MAX_PROMPT_CHARS = 20_000  # rejects pasted novels before tokenising them
MIN_REFERENCE_TOKENS = 16  # an AR run shorter than this is mostly prefill: a poor speed reference
INCOMPLETE_CHAR = "\ufffd"  # what the tokenizer decodes a partial UTF-8 sequence to


T = TypeVar("T")


class ComputeThread:
    """The one thread on which the app runs torch: loading the models, the warm-up and every step.

    OpenMP keeps a team of threads per calling thread, and torch's CPU ops ran much slower when they
    were called from another thread than the one that loaded the model: plain decoding of 128 tokens
    (bf16, 2-core AMD EPYC, no server) made 73 tok/s on the loading thread and 43-48 tok/s when the
    steps ran on other threads, as they did when Gradio's worker threads advanced a handler's
    generator; loading and stepping on one other thread made 72-76. Through the /generate API the app
    measured AR 44 and DART 130 tok/s on a prompt where the engine alone makes 73 and 202."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) on the compute thread; blocks until it returns (or re-raises)."""
        return self._pool.submit(fn, *args, **kwargs).result()


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def engine_threads(cores: int) -> int:
    """torch threads for the engine on a CPU with `cores` cores: all but one, which the web server needs
    (and a browser, on a local demo). The kernels split every op over their OpenMP threads, and an op
    waits for the slowest: with both cores of a 2-core machine given to the engine, one core was taken
    by the server and browser at every frame and the engine stalled at the barriers (headless Chromium
    on the same machine, compare run of a 128-token poem, bf16: AR 27-39 tok/s, DART 30-103 tok/s
    from run to run); with one engine thread the same page measured AR 39-52, DART 111-132 tok/s over
    three runs (the engine alone, one thread: 57 and 160)."""
    return max(1, cores - 1)


class RequestError(ValueError):
    """A request the app refuses; the message is shown to the user as is."""


@dataclass(frozen=True)
class TreeSize:
    """A drafting method's tree sizes in the app: drafted nodes besides the root."""

    default: int  # what a request that names none gets (the size calibrated on this machine, or --max-nodes)
    maximum: int  # the largest a request may ask for: the size its drafter was built at


@dataclass(frozen=True)
class Request:
    """A validated generation request. params.max_nodes is `method`'s tree size (None for AR)."""

    messages: list[dict]
    method: str
    params: GenerationParams
    tree_sizes: dict[str, int] = field(default_factory=dict)  # drafted nodes a tree may have, by drafting method

    def for_method(self, method: str) -> "Request":
        """The same request through another (loaded) method, at that method's tree size: compare mode."""
        return replace(self, method=method, params=replace(self.params, max_nodes=self.tree_sizes.get(method)))


@dataclass
class Step:
    """What the UI shows of one target forward."""

    index: int  # 0 = prefill
    tokens: list[int]  # tokens this step added
    accepted: int  # drafted tokens accepted; the step's last token is the target's own (the bonus)
    span: tuple[int, int, int]  # character offsets in Run.text: [start, mid) accepted drafts, [mid, end) the bonus
    tree: DraftTree | None  # the verified tree (None at prefill)
    path: list[int]  # accepted node indices in the tree, root first
    times: dict[str, float]  # seconds: draft, prune, verify, other
    info: dict  # drafter extras (DART: per-depth top-k lists)
    t: float  # engine seconds since the run started, this step included

    @property
    def has_bonus(self) -> bool:
        """False when a stop (EOS, length) cut the step before the target's own token."""
        return len(self.tokens) == self.accepted + 1


@dataclass
class Run:
    """One generation as it streams: updated in place after every step."""

    method: str
    tree_size: int | None = None  # the most drafted nodes a tree may have in this run (None: AR, a peer)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    summary: Summary | None = None
    engine_s: float = 0.0  # seconds spent inside the generation loop so far
    stopped: bool = False  # the user stopped it before the loop ended (then summary stays None)
    first_token_s: float | None = None  # engine seconds to the first token (the prefill's step)
    reused_tokens: int = 0  # prompt tokens whose KV rows came from the conversation's kept prefix

    @property
    def label(self) -> str:
        """The method's name, with the tree size it ran at: "DART (≤16 nodes)"."""
        return method_label(self.method) + (f" (≤{self.tree_size} nodes)" if self.tree_size is not None else "")

    @property
    def done(self) -> bool:
        return self.summary is not None

    @property
    def live(self) -> bool:
        """Still generating: neither finished nor stopped."""
        return not self.done and not self.stopped

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def forwards(self) -> int:
        """Target forwards so far, the prefill counted as the first."""
        return len(self.steps)

    @property
    def tau(self) -> float:
        """Mean tokens per target forward (accepted drafts + the bonus), the prefill counted as one."""
        return self.new_tokens / max(1, self.forwards)

    @property
    def stop_reason(self) -> str | None:
        return self.summary.stop_reason if self.summary is not None else None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.engine_s if self.engine_s > 0 else 0.0

    @property
    def tree_steps(self) -> list[Step]:
        """Steps that verified a drafted tree (not the prefill, not plain decoding)."""
        return [s for s in self.steps if s.tree is not None and len(s.tree) > 1]

    def tree_step(self, index: int | None) -> Step | None:
        """The tree step nearest to step `index` (None: the latest)."""
        steps = self.tree_steps
        if not steps:
            return None
        if index is None:
            return steps[-1]
        return min(steps, key=lambda s: abs(s.index - index))


def method_label(method: str) -> str:
    """How the page names a method: its label in the one method table (dart_core.tools.methods)."""
    return METHODS[method].label if method in METHODS else method


def peer_label(method: str, gguf_note: str = "same GGUF") -> str:
    """'llamacpp' -> 'llama.cpp (same GGUF)'; 'llamacpp-lookup@4' -> 'llama.cpp lookup@4 (same GGUF)'."""
    base, size = split_peer_method(method)
    return f"{METHODS[base].label}{'' if size is None else f'@{size}'} ({gguf_note})"


def vllm_label(method: str, dtype: str = "float32") -> str:
    """'vllm-dart@2' -> 'vLLM DART (plugin)@2 (converted checkpoint, fp32)'."""
    base, size = split_vllm_method(method)
    weights = {"float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype)
    return f"{METHODS[base].label}{'' if size is None else f'@{size}'} (converted checkpoint, {weights})"


@dataclass(frozen=True)
class Peer:
    """Another engine compare mode runs on the same prompt: a llama.cpp method (dart_core/tools/peers.py)
    or a vLLM one (dart_core/tools/vllm_peer.py)."""

    method: str  # a method name of either: "llamacpp", "llamacpp-lookup@4", "vllm", "vllm-dart@2", ...
    label: str  # how the panes and the summary name it
    runner: object  # has .generate(ids, max_new_tokens, sampling) -> PeerRun (peers.LlamaCppPeer) or VllmRun (vllm_peer.VllmPeer)
    threads: int  # the CPU threads it runs with (the engine's)


@dataclass
class PeerResult(Run):
    """One prompt through a peer: not streamed; its text arrives when it ends.

    Counts and times are the peer's own (as in the bench): new tokens up to the EOS, target forwards
    (plain decoding: one per token; vLLM's drafting methods: its verify steps + the prefill), engine
    time = its prefill + decode (llama.cpp's timers, vLLM's request metrics; process start and model
    load not counted). output_ids: llama.cpp's text re-tokenized with the target's tokenizer, vLLM's ids."""

    peer_label: str = ""
    peer: PeerRun | VllmRun | None = None
    error: str | None = None  # why it failed (shown in its pane and the summary)
    threads: int = 0
    sampled: bool = False  # temperature > 0: llama.cpp's own sampler and random numbers

    @property
    def label(self) -> str:
        return self.peer_label or self.method

    @property
    def engine_name(self) -> str:
        """The peer's engine, as the panes name it: "vLLM" or "llama.cpp"."""
        return "vLLM" if is_vllm(self.method) else "llama.cpp"

    @property
    def done(self) -> bool:
        return self.peer is not None or self.error is not None

    @property
    def new_tokens(self) -> int:
        return self.peer.new_tokens if self.peer is not None else 0

    @property
    def forwards(self) -> int:
        return self.peer.target_forwards if self.peer is not None else 0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.engine_s if self.peer is not None and self.engine_s > 0 else 0.0

    @property
    def stop_reason(self) -> str | None:
        if self.error is not None:
            return "failed"
        if self.peer is None:
            return None
        return "eos" if self.peer.stop == "eos" else "max_new_tokens"


def decode_stable(tokenizer, ids: list[int]) -> str:
    """Decode the whole output, holding back a trailing incomplete UTF-8 character until it completes.
    Decoding each step's tokens separately and concatenating would break multi-byte characters."""
    return tokenizer.decode(ids, skip_special_tokens=True).rstrip(INCOMPLETE_CHAR)


def _as_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int):
        return value
    raise RequestError(f"{name} must be an integer, got {value!r}")


def _as_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)


class Engine:
    """The loaded models and the compute thread that runs one generation step at a time."""

    def __init__(
        self,
        target: Target,
        drafters: dict[str, Drafter],
        max_new_tokens: int,
        max_length: int | None = None,
        compute: ComputeThread | None = None,
        peers: list[Peer] = (),
        default_sizes: dict[str, int] | None = None,
        prefix: PrefixStore | None = None,
    ):
        """compute: the thread that loaded `target` (app/launch.py loads on it); None: a new one.
        peers: what compare mode runs after the engine's methods (llama.cpp), in this order.
        default_sizes: each drafting method's tree size when a request names none (e.g. the size
        calibrated on this machine); a request may ask for any size up to the drafter's max_nodes, the
        size it was built at. Unnamed: the drafter's max_nodes.
        prefix: where conversations' KV rows are kept between runs (None: every run prefills its whole
        prompt); with it, prompts past the kernels' rows run in kernel forwards (model.kernel_prefill),
        which makes the rows exact to reuse."""
        self.target = target
        self.prefix = prefix
        if prefix is not None and target.model.kernel_path(kernels.MAX_ROWS, target.device):
            target.model.kernel_prefill = True
        loaded = {**drafters, "ar": ARDrafter()}
        self.drafters = {m: loaded[m] for m in METHOD_ORDER if m in loaded}
        default_sizes = dict(default_sizes or {})
        unknown = set(default_sizes) - set(drafters)
        if unknown:
            raise ValueError(f"default_sizes names methods without a drafter: {sorted(unknown)}")
        self.tree_sizes: dict[str, TreeSize] = {}
        for m, d in drafters.items():
            default = default_sizes.get(m, d.max_nodes)
            if not 0 <= default <= d.max_nodes:
                raise ValueError(
                    f"{method_label(m)}'s default tree size {default} is not within 0..{d.max_nodes} (its drafter's max_nodes)"
                )
            self.tree_sizes[m] = TreeSize(default, d.max_nodes)
        self.peers = {p.method: p for p in peers}
        self.max_new_tokens = max_new_tokens
        self.max_length = max_length
        self.compute = compute or ComputeThread()
        self.ar_reference: float | None = None  # tokens/s of the latest long-enough AR run

    @property
    def methods(self) -> list[str]:
        return list(self.drafters)

    def label(self, method: str) -> str:
        """A method's or a peer's name on the page."""
        return self.peers[method].label if method in self.peers else method_label(method)

    @property
    def context_limit(self) -> int:
        return min(self.max_length or self.target.context_limit, self.target.context_limit)

    def request(self, messages: list[dict], method, max_new_tokens, temperature, top_p, top_k, tree_sizes=None) -> Request:
        """Validate a request before it runs; raises RequestError naming the offending field.
        tree_sizes: {method: drafted nodes} for any drafting methods (compare mode runs them all); a
        method not named runs at its default size (Engine.tree_sizes)."""
        if method not in METHOD_ORDER:
            raise RequestError(f"unknown method {method!r}: choose one of {', '.join(self.methods)}")
        if method not in self.drafters:
            raise RequestError(f"method {method!r} is not loaded in this app (available: {', '.join(self.methods)})")
        message = messages[-1]["content"] if messages else None
        if not isinstance(message, str):
            raise RequestError(f"the prompt must be text, got {type(message).__name__}")
        if not message.strip():
            raise RequestError("the prompt is empty")
        if len(message) > MAX_PROMPT_CHARS:
            raise RequestError(f"the prompt has {len(message)} characters; the limit is {MAX_PROMPT_CHARS}")
        max_new = _as_int("max_new_tokens", max_new_tokens)
        if not 1 <= max_new <= self.max_new_tokens:
            raise RequestError(f"max_new_tokens must be between 1 and {self.max_new_tokens} (this app's --max-new-tokens), got {max_new}")
        try:
            sampling = SamplingParams(_as_float("temperature", temperature), _as_float("top_p", top_p), _as_int("top_k", top_k))
        except RequestError:
            raise
        except ValueError as e:  # SamplingParams names the field and the allowed range
            raise RequestError(str(e)) from None
        sizes = self._tree_sizes(tree_sizes)
        n_prompt = len(self.target.encode(messages))
        if n_prompt >= self.context_limit:
            raise RequestError(
                f"the conversation has {n_prompt} tokens and the context limit is {self.context_limit}: "
                "shorten the prompt (or clear the chat)"
            )
        return Request(messages, method, GenerationParams(max_new, self.max_length, sampling, sizes.get(method)), sizes)

    def _tree_sizes(self, asked) -> dict[str, int]:
        """Every drafting method's tree size for a request: the asked ones checked, the defaults for the rest."""
        if asked is None:
            asked = {}
        if not isinstance(asked, dict):
            raise RequestError(f"tree sizes must be given by method, got {type(asked).__name__}")
        sizes = {m: s.default for m, s in self.tree_sizes.items()}
        for m, n in asked.items():
            if m not in self.tree_sizes:
                drafting = ", ".join(self.tree_sizes) or "none is loaded"
                raise RequestError(f"a tree size was given for {m!r}, which drafts no tree (drafting methods: {drafting})")
            n, top = _as_int(f"{method_label(m)}'s tree size", n), self.tree_sizes[m].maximum
            if not 0 <= n <= top:  # 0: no drafted node, plain decoding's steps through the method's loop
                raise RequestError(f"{method_label(m)}'s tree size must be between 0 and {top} drafted nodes, got {n}")
            sizes[m] = n
        return sizes

    @property
    def prefix_exact(self) -> bool:
        """Whether runs reuse kept prefixes here: a store, and prompts of any length prefilled row-exact."""
        return self.prefix is not None and self.target.prefill_exact(self.context_limit)

    def prefix_line(self) -> str:
        """What the header says of the prefix cache."""
        if self.prefix is None:
            return "each turn prefills the whole conversation (no prefix cache)"
        if not self.prefix_exact:
            exact = next((n for n in range(self.context_limit, 0, -1) if self.target.prefill_exact(n)), 0)
            return (
                f"a conversation's KV cache is reused only while it has at most {exact} tokens: a longer prompt's prefill "
                "here does not give each row its one-token step's bits, and reuse would change the answers"
            )
        return (
            f"a conversation's KV cache is kept between its turns, up to {self.prefix.max_bytes / 2**20:.0f} MiB for all visitors "
            "(exact: every row has its one-token step's bits, so the answers are the same as with a full prefill)"
        )

    def forget(self, owner) -> int:
        """Drop what the prefix cache holds for `owner` (Clear, a closed session); returns how many entries."""
        return 0 if self.prefix is None else self.prefix.drop(owner)

    def stream(self, req: Request, owner=None) -> Iterator[Run]:
        """Run one generation, yielding the same Run, updated, after each step. owner: whose kept
        prefixes it may reuse and where its own is kept (the browser session); None: none.

        The lock is held while a step computes, never between steps: a consumer that stops iterating
        without closing the generator (a cancelled request whose thread is abandoned) cannot keep the
        engine from the next request. Runs own their KV caches, so steps of two runs may interleave;
        the app's single concurrency group keeps whole runs in order."""
        run = Run(req.method, req.params.max_nodes)
        scope = PrefixScope(self.prefix, owner) if self.prefix is not None and owner is not None else None
        events = generate(self.target, req.messages, self.drafters[req.method], req.params, scope)  # lazy: nothing runs yet
        for event in self._timed(events, run):
            if isinstance(event, Summary):
                run.summary = event
                run.text = self.target.tokenizer.decode(run.output_ids, skip_special_tokens=True)  # nothing held back
                if req.method == "ar" and run.new_tokens >= MIN_REFERENCE_TOKENS:
                    self.ar_reference = run.tokens_per_s
            else:
                append_step(run, event, self.target.tokenizer)
            yield run

    def complete(self, req: Request, owner=None) -> Run:
        run = None
        for run in self.stream(req, owner):
            pass
        return run

    def run_peer(self, req: Request, method: str) -> PeerResult:
        """The request's prompt through a peer (compare mode): the same prompt ids (the chat template
        applied by our tokenizer), max_new_tokens and sampling settings. It runs on the compute thread,
        so never beside an engine step on the same cores. A failure (llama.cpp's exit status, a timeout,
        output it cannot read) is returned in .error, never raised: the turn and the app go on."""
        peer = self.peers[method]
        result = PeerResult(method, peer_label=peer.label, threads=peer.threads, sampled=not req.params.sampling.greedy)
        try:
            ids = self.target.encode(req.messages)
            run = self.compute.run(peer.runner.generate, ids, req.params.max_new_tokens, req.params.sampling)
        except PeerError as e:
            result.error = str(e)
            return result
        except Exception as e:  # noqa: BLE001 (anything else a subprocess can raise: shown, not fatal)
            result.error = f"{type(e).__name__}: {e}"
            return result
        result.peer, result.text, result.output_ids, result.engine_s = run, run.text, list(run.output_ids), run.wall_s
        return result

    def speedup(self, run: Run, ar_run: Run | None = None) -> float | None:
        """run's tokens/s over plain decoding's: the AR run of the same comparison when given, else
        the latest AR measurement (warm-up or an earlier request); None when there is none."""
        if run.method == "ar" or (isinstance(run, PeerResult) and run.peer is None):
            return None
        ref = ar_run.tokens_per_s if ar_run is not None and ar_run.new_tokens else self.ar_reference
        return run.tokens_per_s / ref if ref else None

    def _timed(self, events: Iterator, run: Run) -> Iterator:
        """The loop's events, each produced on the compute thread, with the time spent producing them
        (not waiting for the thread) added to run.engine_s."""

        def step() -> tuple[StepEvent | Summary | None, float]:
            t0 = time.perf_counter()
            try:
                event = next(events)
            except StopIteration:
                event = None
            return event, time.perf_counter() - t0

        while True:
            event, seconds = self.compute.run(step)
            run.engine_s += seconds
            if event is None:
                return
            yield event


def append_step(run: Run, e: StepEvent, tokenizer) -> None:
    """Add one step's tokens to the run: re-decode the whole output (multi-byte safe) and record the
    character span of the accepted drafts and of the bonus token."""
    start = len(run.text)
    run.output_ids.extend(e.new_tokens)
    run.text = decode_stable(tokenizer, run.output_ids)
    end = len(run.text)
    bonus = len(e.new_tokens) == e.accepted + 1
    if e.accepted and bonus:
        mid = min(max(len(decode_stable(tokenizer, run.output_ids[:-1])), start), end)
    else:
        mid = start if bonus else end  # only the target's token / only accepted drafts (a stop cut the step)
    if e.step == 0:
        run.first_token_s, run.reused_tokens = run.engine_s, e.info.get("reused", 0)
    times = {"draft": e.times.draft, "prune": e.times.prune, "verify": e.times.verify, "other": e.times.other}
    run.steps.append(Step(e.step, list(e.new_tokens), e.accepted, (min(start, end), mid, end), e.tree, e.path, times, e.info, run.engine_s))
