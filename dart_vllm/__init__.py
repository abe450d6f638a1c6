"""DART as a vLLM speculative method (a vLLM plugin; `make vllm` installs it beside vLLM).

    from vllm import LLM
    import dart_vllm
    llm = LLM(model=TARGET, speculative_config=dart_vllm.speculative_config("path/to/dart-head", 4))

vLLM loads `register` in every process through the `vllm.general_plugins` entry point (pyproject.toml).
It registers the DART head as a draft architecture (dart_vllm.model) and wraps the proposer so that
DART's pruner chooses the chain vLLM verifies (dart_vllm.hooks, dart_vllm.chains). docs/vllm.md has
the install, `vllm serve` and what was measured.
"""

from __future__ import annotations

import os

SUPPORTED_VLLM = ("0.32.",)  # the versions whose proposer internals dart_vllm.hooks was written against


def check_version(version: str) -> None:
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"dart_vllm supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; this is vLLM {version} "
            "(its speculative-decoding internals differ): install a supported vLLM or uninstall dart-demo from this environment"
        )


def register() -> None:
    """vLLM's plugin entry point: runs in every vLLM process before a model is built."""
    import vllm
    from vllm import ModelRegistry

    check_version(vllm.__version__)
    from . import hooks

    # the name vLLM's EAGLE3 config gives a DART head (hooks), and the one our heads' config.json carries
    # (vLLM checks a draft's own architecture before it wraps the config)
    for name in (hooks.ARCHITECTURE, hooks.CHECKPOINT_ARCHITECTURE):
        ModelRegistry.register_model(name, "dart_vllm.model:DartDraftForCausalLM")
    hooks.install()


def speculative_config(head: str | os.PathLike, num_speculative_tokens: int) -> dict:
    """vLLM's speculative_config for a DART head (a directory in the upstream format): an `eagle3`
    draft with parallel drafting, which the plugin turns into DART."""
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": int(num_speculative_tokens), "parallel_drafting": True}
