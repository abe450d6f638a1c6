"""The methods the bench and the app run, declared once: what generates (our generation loop with a
drafter, transformers' own generate, or llama.cpp's binaries) and how the method is named.

A drafter method takes a tree size after @ (`dart@16`: DART at 16 drafted nodes, i.e.
replace(config, max_nodes=16)); llama.cpp methods take a draft length the same way
(`llamacpp-lookup@4`, dart_core/tools/peers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from .peers import PEER_METHODS, split_peer_method
from .vllm_peer import VLLM_METHODS, split_vllm_method

LOOP, HF, PEER, VLLM = "loop", "hf", "peer", "vllm"  # what runs a method


@dataclass(frozen=True)
class Method:
    name: str
    label: str  # how the app and the reports name it
    engine: str  # LOOP: our generation loop; HF: transformers' generate; PEER: llama.cpp (dart_core/tools/peers.py);
    # VLLM: vLLM's engine in its own venv (dart_core/tools/vllm_peer.py)
    drafter: str | None = None  # the loop's drafter (dart_core.drafters.registry); None: plain decoding
    context: bool = True  # DART's context n-gram (off: dart-noctx, the ablation)
    adaptive: bool = False  # DART's tree size chosen per step (dart-adaptive; DartConfig.adaptive)
    prompt_lookup: bool = False  # transformers' prompt-lookup decoding

    @property
    def sized(self) -> bool:
        """Whether method@N runs it at N drafted nodes (a tree-size sweep in one run)."""
        return self.drafter is not None


def _peer_label(name: str) -> str:
    return "llama.cpp" if name == "llamacpp" else "llama.cpp " + name.removeprefix("llamacpp-")


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("ar", "AR", LOOP),
        Method("hf", "transformers", HF),
        Method("pld", "transformers prompt lookup", HF, prompt_lookup=True),
        Method("dart", "DART", LOOP, "dart"),
        Method("dart-noctx", "DART without the context n-gram", LOOP, "dart", context=False),
        Method("dart-adaptive", "DART, adaptive tree size", LOOP, "dart", adaptive=True),
        Method("eagle3", "EAGLE3", LOOP, "eagle3"),
        *(Method(p, _peer_label(p), PEER) for p in PEER_METHODS),
        Method("vllm", "vLLM", VLLM),
        Method("vllm-eagle3", "vLLM EAGLE3", VLLM),
        Method("vllm-dart", "vLLM DART (plugin)", VLLM),
    )
}
SIZED_METHODS = tuple(name for name, m in METHODS.items() if m.sized)


def is_peer(name: str) -> bool:
    """Whether a method name (maybe with @N) runs in another process (llama.cpp or vLLM) rather than our engine."""
    return METHODS[split_method(name)[0]].engine in (PEER, VLLM)


def is_llamacpp(name: str) -> bool:
    return METHODS[split_method(name)[0]].engine == PEER


def is_vllm(name: str) -> bool:
    return METHODS[split_method(name)[0]].engine == VLLM


def split_method(name: str) -> tuple[str, int | None]:
    """'dart@16' -> ('dart', 16): a drafter method at another tree size (max_nodes); 'dart' -> ('dart', None).
    llama.cpp methods take a draft length the same way ('llamacpp-lookup@4'). ValueError for an
    unknown method or a bad size."""
    if name.partition("@")[0] in PEER_METHODS:
        return split_peer_method(name)
    if name.partition("@")[0] in VLLM_METHODS:  # @N: vLLM's draft tokens a step
        return split_vllm_method(name)
    base, at, size = name.partition("@")
    if base not in METHODS:
        raise ValueError(f"unknown method {base!r}: choose from {', '.join(METHODS)}")
    if not at:
        return base, None
    if not METHODS[base].sized:
        raise ValueError(f"{name!r}: only {', '.join(SIZED_METHODS)} take a tree size (@N)")
    if not size.isdigit() or int(size) < 1:
        raise ValueError(f"{name!r}: the tree size after @ must be a positive integer (drafted nodes besides the root)")
    return base, int(size)
