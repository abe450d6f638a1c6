"""Parity with upstream DART (fvliang/DART) where a user of its published files would meet us:

- n-gram hub ids resolve as heads do (the local Hugging Face cache first, then the hub; offline, an
  error naming the id), and a Qwen3 target with a named head and no --ngram-model gets upstream's
  default trie from the cache, or a note saying it runs without one;
- the pruner's EOS is the tokenizer's eos_token_id, as upstream's, while every EOS id of the target
  still stops the loop (a tiny Qwen3-like target whose tokenizer ends turns with <|im_end|> and whose
  generation config also stops at the lower <|endoftext|>, as Qwen3's);
- `dart-export-upstream` writes a head that, read as upstream's loader reads it (key
  names, shapes, config fields, the final norm applied twice), gives our head's logits;
- upstream's `qwen3_8b_app.sh` command line starts the app on tiny stand-ins placed in an HF cache.

Everything runs offline: the hub is never reached (HF_HUB_OFFLINE), the caches are built in tmp dirs
in the layout huggingface_hub writes (refs/main, snapshots/<commit>/ -> blobs/).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ngram_cpp
from dart_core import ARDrafter, GenerationParams, complete
from dart_core.cli.options import add_drafter_flags, dart_config
from dart_core.drafters.dart import DartDrafter, DartParams
from dart_core.drafters.head import load_head
from dart_core.drafters.registry import UPSTREAM_NGRAM, ngram_choice, resolve_ngram
from dart_core.target import load_target
from dart_core.tools.export_upstream import export_upstream
from dart_core.tools.training import new_head_from_target

from support import TINY_VOCAB, build_tiny_checkpoint, tiny_target

ROOT = Path(__file__).resolve().parent.parent
# A Qwen3-like vocabulary: <|endoftext|> (Qwen3 151643) is the lower stop id, <|im_end|> (151645) the tokenizer's EOS.
SPECIAL = ["<pad>", "<bos>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
ENDOFTEXT, IM_END = SPECIAL.index("<|endoftext|>"), SPECIAL.index("<|im_end|>")
WORDS = [f"w{i}" for i in range(len(SPECIAL), TINY_VOCAB)]
TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
D = 3  # mask slots of the tiny DART heads


def build_qwen3_like(path: Path, seed: int = 4) -> Path:
    """A tiny random Qwen3 checkpoint with a word-level tokenizer and chat template whose EOS ids
    are Qwen3's pair: tokenizer eos <|im_end|>, generation_config eos [<|im_end|>, <|endoftext|>]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    build_tiny_checkpoint(path, "qwen3", seed=seed)
    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, ENDOFTEXT], "pad_token_id": ENDOFTEXT}))
    return path


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return build_qwen3_like(tmp_path_factory.mktemp("qwen3like"))


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    return load_target(qwen3_dir, "cpu", "float32")


def random_head(target, draft_ids: torch.Tensor, draft_length: int | None, seed: int = 0):
    """A head shaped for `target` with random weights that are not small, and a final-norm weight far
    from 1 (so that a norm applied once or twice differ visibly)."""
    g = torch.Generator().manual_seed(seed)
    head = new_head_from_target(target, draft_ids, draft_length, seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        head.norm.weight.copy_(0.5 + torch.rand(head.norm.weight.shape, generator=g))
    return head.eval()


def parse(*argv):
    """DART's config from its flags, for a target other than the embedded default."""
    import argparse

    p = argparse.ArgumentParser()
    add_drafter_flags(p)
    return dart_config(p.parse_args(list(argv)), default_target=False)


# ---------------------------------------------------------------------------------------------- HF cache


def put_in_hf_cache(hub_cache: Path, repo_id: str, files: dict[str, Path | bytes]) -> Path:
    """Place files as huggingface_hub caches a download of `repo_id`: blobs by content hash,
    snapshots/<commit>/<name> as relative symlinks to them, refs/main naming the commit."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for name, content in files.items():
        data = content if isinstance(content, bytes) else Path(content).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def upstream_trie_bytes(sequences, order: int = 3) -> tuple[bytes, int]:
    """An upstream `.trie` file as its TrieNgram.add_conversation + save write it (upstream's ngram C++ sources; docs/upstream.md):
    every slice tokens[s:s+order] inserted from the root, +1 on each node of the path, root included;
    then order u64, node count u64, and per node token i32, parent u64, freq i32, n_children u64,
    (child token i32, child index u64)... Returns (bytes, node count)."""
    nodes = [[0, 0, 0, {}]]  # token, parent, freq, children
    for seq in sequences:
        for s in range(len(seq)):
            cur = 0
            nodes[0][2] += 1
            for tok in seq[s : s + order]:
                kids = nodes[cur][3]
                if tok not in kids:
                    kids[tok] = len(nodes)
                    nodes.append([tok, cur, 0, {}])
                cur = kids[tok]
                nodes[cur][2] += 1
    out = bytearray(struct.pack("<QQ", order, len(nodes)))
    for tok, parent, freq, kids in nodes:
        out += struct.pack("<iQiQ", tok, parent, freq, len(kids))
        for t, i in kids.items():
            out += struct.pack("<iQ", t, i)
    return bytes(out), len(nodes)


TRIE_SEQUENCES = [[(7 * i + 3 * j) % TINY_VOCAB for j in range(30)] + [IM_END] for i in range(12)]


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty HF hub cache, offline, for this process (what HF_HOME + HF_HUB_OFFLINE=1 give a new one)."""
    from huggingface_hub import constants

    hub = tmp_path / "hf" / "hub"
    hub.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


# ---------------------------------------------------------------------------------------------- n-gram hub ids


def test_ngram_hub_id_resolves_from_the_hf_cache_and_offline_names_the_id(hf_cache, qwen3):
    small, n_nodes = upstream_trie_bytes(TRIE_SEQUENCES)
    snapshot = put_in_hf_cache(hf_cache, UPSTREAM_NGRAM, {"small.trie": small})
    # upstream's own spelling of the flag, as in its qwen3_*_app.sh
    path = resolve_ngram(parse("--ngram-model-name-or-path", UPSTREAM_NGRAM, "--use-small-ngram"))
    assert path == snapshot / "small.trie"
    model = ngram_cpp.load(path, expected_vocab_size=qwen3.vocab_size)
    assert model.num_nodes == n_nodes
    follow = [s[k + 2] for s in TRIE_SEQUENCES for k in range(len(s) - 2) if s[k : k + 2] == TRIE_SEQUENCES[0][:2]]
    assert model.prob(TRIE_SEQUENCES[0][:2], TRIE_SEQUENCES[0][2]) == follow.count(TRIE_SEQUENCES[0][2]) / len(follow)
    # full.trie is not cached, and offline the hub cannot supply it: the error names the id and the file
    with pytest.raises(FileNotFoundError, match=f"{UPSTREAM_NGRAM}.*full.trie"):
        resolve_ngram(parse("--ngram-model-name-or-path", UPSTREAM_NGRAM))
    with pytest.raises(FileNotFoundError, match="'someone/not-cached'"):
        resolve_ngram(parse("--ngram-model", "someone/not-cached", "--use-small-ngram"))
    # a local path still wins, and one that does not exist is not taken for a hub id
    with pytest.raises(FileNotFoundError, match="no n-gram file"):
        resolve_ngram(parse("--ngram-model", "./fvliang/dart-qwen3-ngram"))


def test_default_trie_for_a_named_head_on_a_qwen3_target(hf_cache, qwen3, tiny_llama):
    """Upstream's app defaults to fvliang/dart-qwen3-ngram: so do we for a Qwen3 target with a named
    head, from the HF cache (or the hub); when it is not to be had, no trie, and the note says why."""
    named = ("--dart-model-name-or-path", "some/head", "--use-small-ngram")
    missing = ngram_choice(parse(*named), qwen3)
    assert missing.path is None and UPSTREAM_NGRAM in missing.note and "small.trie" in missing.note
    snapshot = put_in_hf_cache(hf_cache, UPSTREAM_NGRAM, {"small.trie": upstream_trie_bytes(TRIE_SEQUENCES)[0]})
    found = ngram_choice(parse(*named), qwen3)
    assert found.path == snapshot / "small.trie" and UPSTREAM_NGRAM in found.note
    # another tokenizer's target: upstream's trie would be nonsense there
    other = ngram_choice(parse(*named), tiny_llama)
    assert other.path is None and "Qwen3 token ids" in other.note
    assert ngram_choice(parse(*named, "--no-ngram"), qwen3).path is None
    assert ngram_choice(parse("--use-small-ngram"), qwen3).path is None  # the embedded head: no default fetch


# ---------------------------------------------------------------------------------------------- EOS


def test_pruner_eos_is_the_tokenizers(qwen3):
    """Upstream's pruner never extends a branch past tokenizer.eos_token_id (<|im_end|>), not past the
    lower <|endoftext|>: with every token a candidate at both depths and room for the whole beam, the
    tree extends <|endoftext|> and not <|im_end|>."""
    assert qwen3.eos_ids == {ENDOFTEXT, IM_END} and qwen3.tokenizer.eos_token_id == IM_END and ENDOFTEXT < IM_END
    vd = 8
    head = random_head(qwen3, torch.arange(vd), draft_length=1, seed=1)  # the draft vocabulary holds both EOS ids
    params = DartParams(ngram_cpp.PruneParams(top_k=vd, beam_width=vd, max_nodes=vd * vd, use_ngram=False))
    drafter = DartDrafter(head, qwen3, None, params, use_kernels=False)
    assert drafter.eos_id == IM_END
    prompt = qwen3.encode("w20 w21 w22")
    session = drafter.new_session(64)
    session.extend(prompt[:-1], qwen3.prefill(prompt[:-1], qwen3.new_cache(64), capture=True).hidden)
    tree = session.propose(prompt[-1], vd * vd).tree
    first = {int(tree.tokens[i]): i for i in range(1, len(tree)) if int(tree.depths[i]) == 1}
    assert {ENDOFTEXT, IM_END} <= set(first)
    assert tree.children[first[IM_END]] == ()  # an answer's end is never drafted past
    assert len(tree.children[first[ENDOFTEXT]]) == vd  # <|endoftext|> is an ordinary token to the pruner


@pytest.mark.parametrize("eos", [ENDOFTEXT, IM_END])
def test_every_eos_id_stops_the_loop(qwen3_dir, tmp_path, eos):
    """Either EOS id ends generation, for AR and for DART (whose pruner treats only <|im_end|> as EOS).
    The checkpoint is changed so that greedy decoding emits `eos` where it first emitted a token it
    had not emitted before, a few tokens in: lm_head's row of `eos` becomes 1.05 x that token's row."""
    base = tiny_target(qwen3_dir)
    base.eos_ids = frozenset()

    def late_new_token(prompt):
        free = complete(base, prompt, ARDrafter(), GenerationParams(24)).output_ids
        return next((t for k, t in enumerate(free) if k >= 3 and t not in free[:k] and t not in (ENDOFTEXT, IM_END)), None)

    prompt, victim = next(
        (p, v) for p in ([20, 21, 22, 23], [77, 30, 9, 15, 64], [40, 50, 60], [11, 12], [90, 91]) if (v := late_new_token(p)) is not None
    )
    path = tmp_path / "q3"
    path.mkdir()
    for f in qwen3_dir.iterdir():
        if f.name != "model.safetensors":
            (path / f.name).write_bytes(f.read_bytes())
    state = load_file(str(qwen3_dir / "model.safetensors"))
    state["lm_head.weight"][eos] = 1.05 * state["lm_head.weight"][victim]
    save_file(state, str(path / "model.safetensors"))
    target = load_target(path, "cpu", "float32")
    assert target.eos_ids == {ENDOFTEXT, IM_END}
    ar = complete(target, prompt, ARDrafter(), GenerationParams(24))
    assert ar.stop_reason == "eos" and ar.output_ids[-1] == eos and len(ar.output_ids) < 24
    head = random_head(target, torch.randperm(TINY_VOCAB, generator=torch.Generator().manual_seed(0))[:64].sort().values, D, seed=2)
    dart = complete(
        target,
        prompt,
        DartDrafter(head, target, None, DartParams(ngram_cpp.PruneParams(top_k=8, beam_width=4, max_nodes=12))),
        GenerationParams(24),
    )
    assert dart.output_ids == ar.output_ids and dart.stop_reason == "eos"


# ---------------------------------------------------------------------------------------------- export


def upstream_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """LlamaForCausalLMDart's parameters and persistent buffers (dart/model/llama3_dart.py), sized from config.json
    with DartConfig's fallbacks (num_key_value_heads: the head count; head_dim: H / heads; fc input:
    3 x target_hidden_size, else 3 x H)."""
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or H // heads
    Ht = cfg.get("target_hidden_size") or H
    V, Vd = cfg["vocab_size"], cfg["draft_vocab_size"]
    return {
        "embed_tokens.weight": (V, H),
        "fc.weight": (H, 3 * Ht),
        "midlayer.mask_rep": (2 * H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, heads * hd),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (Vd, H),
        "d2t": (Vd,),
        "t2d": (V,),
    }


def upstream_read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and model.safetensors as DartModel reads them: load_state_dict(strict=False) would
    silently skip a missing or misnamed key, so the test asserts there is none (embed_tokens aside:
    upstream overwrites it with the target's)."""
    cfg = json.loads((path / "config.json").read_text())
    assert isinstance(cfg["draft_vocab_size"], int) and isinstance(cfg["draft_length"], int)  # required by upstream
    state = load_file(str(path / "model.safetensors"))
    shapes = upstream_shapes(cfg)
    assert set(state) - set(shapes) == set(), "keys upstream would ignore"
    assert set(shapes) - set(state) <= {"embed_tokens.weight"}, "keys upstream would leave at their random init"
    for k, v in state.items():
        assert tuple(v.shape) == shapes[k], k
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    return cfg, state


def upstream_prefill_logits(cfg: dict, state: dict, embed: torch.Tensor, aux: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Upstream's draft forward at prefill (dart/model/llama3_dart.py), written from its code in plain torch, fp32:
    S real positions (fc(aux), the embeddings of the ids shifted by one) then D mask slots, one causal
    Llama layer, the last D+1 rows, the final norm TWICE, lm_head. -> (D+1, Vd)."""
    H, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or H // heads
    D, theta = cfg["draft_length"], float(cfg.get("rope_theta", 10000.0))
    W = {k: v.float() for k, v in state.items() if v.is_floating_point()}

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    g = aux @ W["fc.weight"].T
    u = torch.cat((rms(embed[ids], W["midlayer.input_layernorm.weight"]), rms(g, W["midlayer.hidden_norm.weight"])), -1)
    mask = W["midlayer.mask_rep"]
    u = torch.cat((u, mask.expand(D, -1)))
    residual = torch.cat((g, mask[:H].expand(D, -1)))
    T = u.shape[0]
    q = (u @ W["midlayer.self_attn.q_proj.weight"].T).view(T, heads, hd).transpose(0, 1)
    k = (u @ W["midlayer.self_attn.k_proj.weight"].T).view(T, kv, hd).transpose(0, 1)
    v = (u @ W["midlayer.self_attn.v_proj.weight"].T).view(T, kv, hd).transpose(0, 1)
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(T).float()[:, None] * inv[None]
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()

    def rope(x):
        return x * cos + torch.cat((-x[..., hd // 2 :], x[..., : hd // 2]), -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = (q @ k.transpose(1, 2)) / hd**0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, heads * hd)
    h = (residual + attn @ W["midlayer.self_attn.o_proj.weight"].T)[-(D + 1) :]
    x = rms(h, W["midlayer.post_attention_layernorm.weight"])
    h = (
        h
        + (torch.nn.functional.silu(x @ W["midlayer.mlp.gate_proj.weight"].T) * (x @ W["midlayer.mlp.up_proj.weight"].T))
        @ W["midlayer.mlp.down_proj.weight"].T
    )
    h = rms(rms(h, W["norm.weight"]), W["norm.weight"])  # upstream: LlamaForCausalLMDart.forward, then compute_logits
    return h @ W["lm_head.weight"].T


def test_export_runs_under_upstreams_reading(qwen3, tmp_path):
    """Our head (final norm once) exported, read the way upstream's loader reads it and run with its
    double norm, gives our logits. Tolerance (fp32): 5e-5 relative + 1e-5 absolute. The fold is exact
    up to one factor per row, s = (m/(m+eps) + eps)^-1/2 with m the row's mean square before the norm
    (dart_core/tools/export_upstream.py): |1 - s| ~ eps/2 |1 - 1/m|, which is 1.8e-5 on this random head's
    real row (m 0.027, eps 1e-6) and 1e-7 on its mask rows; summation order adds ~1e-6 absolute.
    Reading the head without the export is off by far more."""
    ids = torch.randperm(TINY_VOCAB, generator=torch.Generator().manual_seed(3))[:64].sort().values
    head = random_head(qwen3, ids, D, seed=3)
    head.save(tmp_path / "ours", dtype=torch.float32)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["dart_double_norm"] is False
    assert export_upstream(tmp_path / "ours", tmp_path / "up") is True

    prompt = qwen3.encode("w30 w31 w32 w33 w34 w35")
    root = 40
    aux = qwen3.prefill(prompt, qwen3.new_cache(64), capture=True).hidden
    session = DartDrafter(load_head(tmp_path / "ours", dart=True, target=qwen3), qwen3, None, use_kernels=False).new_session(64)
    session.extend(prompt, aux)
    ours = session.draft_logits(root)

    embed = qwen3.model.tok_embeddings.weight.float()  # upstream copies the target's embedding into the head
    next_ids = torch.tensor(prompt[1:] + [root])
    cfg, state = upstream_read(tmp_path / "up")
    assert cfg["target_hidden_size"] == qwen3.hidden_size and cfg["vocab_size"] == qwen3.vocab_size and cfg["draft_length"] == D
    theirs = upstream_prefill_logits(cfg, state, embed, aux, next_ids)
    assert theirs.shape == ours.shape == (D + 1, 64)
    torch.testing.assert_close(theirs, ours, rtol=5e-5, atol=1e-5)
    assert torch.equal((torch.arange(64) + state["d2t"])[theirs.argmax(-1)], head.to_target_ids(ours.argmax(-1)))

    # the same reading of the head as trained (no export): upstream's second norm makes it another head
    unexported = upstream_prefill_logits(*upstream_read(tmp_path / "ours"), embed, aux, next_ids)
    assert (unexported - ours).abs().max() > 1000 * 5e-5
    # our loader reads the export too (dart_double_norm: true) and runs it as upstream does
    again = DartDrafter(load_head(tmp_path / "up", dart=True, target=qwen3), qwen3, None, use_kernels=False).new_session(64)
    again.extend(prompt, aux)
    torch.testing.assert_close(again.draft_logits(root), ours, rtol=5e-5, atol=1e-5)
    # a head that applies the norm twice already is written unchanged
    assert export_upstream(tmp_path / "up", tmp_path / "up2") is False
    assert all(torch.equal(v, state[k]) for k, v in load_file(str(tmp_path / "up2" / "model.safetensors")).items())
    # an EAGLE3 head is refused
    random_head(qwen3, ids, None).save(tmp_path / "eagle3")
    with pytest.raises(ValueError, match="not a DART head"):
        export_upstream(tmp_path / "eagle3", tmp_path / "nope")


# ---------------------------------------------------------------------------------------------- the app


# dart/app/qwen3_8b_app.sh at fvliang/DART 13f34a5, flag for flag; the script's CUDA device is the one
# change (this machine has none). --share and --listen only matter once the page is served: the test
# builds the app (models, warm-up, page) with main()'s own build_app, without serving it.
UPSTREAM_8B_ARGV = [
    "--base-model-name-or-path",
    "Qwen/Qwen3-8B",
    "--dart-model-name-or-path",
    "fvliang/qwen8b-dart",
    "--ngram-model-name-or-path",
    "fvliang/dart-qwen3-ngram",
    "--template-name",
    "qwen",
    "--device",
    "cuda",
    "--max-new-tokens",
    "5120",
    "--max-length",
    "6400",
    "--share",
    "--use-small-ngram",
    "--compare-eagle3",
    "--eagle3-model-name-or-path",
    "AngelSlim/Qwen3-8B_eagle3",
    "--listen",
    "--server-port",
    "30000",
]

APP_PROBE = r"""
import json, sys
from app.launch import build_app, parse_args
args = parse_args(sys.argv[1:])
demo, loaded, settings = build_app(args)
engine = loaded.engine
dart = engine.drafters.get("dart")
runs = {m: engine.complete(engine.request([{"role": "user", "content": "w40 w41 w42 w43"}], m, 16, 0.0, 1.0, 0)) for m in engine.methods}
print(json.dumps({
    "demo": type(demo).__name__, "methods": engine.methods, "compare": settings.compare, "exact": settings.exact,
    "notes": list(settings.notes), "target": engine.target.name,
    "ngram_nodes": None if dart is None or dart.ngram is None else dart.ngram.num_nodes,
    "pruner_eos": None if dart is None else dart.eos_id,
    "outputs": {m: r.output_ids for m, r in runs.items()},
}))
"""


def run_app(argv: list[str], hf_home: Path) -> dict:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", APP_PROBE, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def upstream_files(tmp_path_factory, qwen3_dir, qwen3):
    """Tiny stand-ins for the script's target, DART head (published heads apply the norm twice: ours,
    exported), EAGLE3 head and trie, in an HF cache under the ids the script names."""
    tmp = tmp_path_factory.mktemp("upstream-app")
    ids = torch.randperm(TINY_VOCAB, generator=torch.Generator().manual_seed(5))[:64].sort().values
    random_head(qwen3, ids, D, seed=5).save(tmp / "dart-ours", dtype=torch.float32)
    export_upstream(tmp / "dart-ours", tmp / "dart")
    random_head(qwen3, ids, None, seed=6).save(tmp / "eagle3", dtype=torch.float32)
    trie, n_nodes = upstream_trie_bytes(TRIE_SEQUENCES)
    hub = tmp / "hf" / "hub"
    put_in_hf_cache(hub, "Qwen/Qwen3-8B", {f.name: f for f in qwen3_dir.iterdir()})
    put_in_hf_cache(hub, "fvliang/qwen8b-dart", {f: tmp / "dart" / f for f in ("config.json", "model.safetensors")})
    put_in_hf_cache(hub, "AngelSlim/Qwen3-8B_eagle3", {f: tmp / "eagle3" / f for f in ("config.json", "model.safetensors")})
    put_in_hf_cache(hub, UPSTREAM_NGRAM, {"small.trie": trie})
    return tmp, n_nodes


@pytest.mark.slow
def test_upstream_8b_app_command_line_starts_the_app(upstream_files):
    tmp, n_nodes = upstream_files
    argv = [("cpu" if a == "cuda" else a) for a in UPSTREAM_8B_ARGV]
    out = run_app(argv, tmp / "hf")
    assert out["demo"] == "Blocks" and out["target"] == "Qwen/Qwen3-8B"
    assert out["methods"] == ["dart", "eagle3", "ar"] and out["compare"]
    assert out["ngram_nodes"] == n_nodes  # DART prunes with the small.trie found in the cache
    assert out["pruner_eos"] == IM_END  # upstream's: the tokenizer's eos_token_id
    assert any("--template-name qwen ignored" in n for n in out["notes"])
    assert not any("n-gram" in n for n in out["notes"]), out["notes"]
    assert all(len(ids) >= 1 for ids in out["outputs"].values())
    if out["exact"]:  # greedy: every method's tokens are AR's
        assert out["outputs"]["dart"] == out["outputs"]["ar"] == out["outputs"]["eagle3"]


@pytest.mark.slow
def test_upstream_app_without_the_trie_says_so(upstream_files, tmp_path):
    """The same command line without --ngram-model-name-or-path, where upstream's default trie is not
    in the cache and the hub is unreachable: DART runs without a trie and the header says why."""
    tmp, _ = upstream_files
    hub = tmp_path / "hf" / "hub"
    hub.mkdir(parents=True)
    for repo in ("models--Qwen--Qwen3-8B", "models--fvliang--qwen8b-dart", "models--AngelSlim--Qwen3-8B_eagle3"):
        (hub / repo).symlink_to(tmp / "hf" / "hub" / repo)
    argv = [("cpu" if a == "cuda" else a) for a in UPSTREAM_8B_ARGV]
    i = argv.index("--ngram-model-name-or-path")
    del argv[i : i + 2]
    out = run_app(argv, tmp_path / "hf")
    assert out["methods"] == ["dart", "eagle3", "ar"] and out["ngram_nodes"] is None
    assert any("without an n-gram model" in n and UPSTREAM_NGRAM in n for n in out["notes"]), out["notes"]
