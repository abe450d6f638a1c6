"""DART head: checkpoint format round trip and refusals, training forward == inference forward,
and lossless greedy decoding with the DART drafter on tiny targets and the embedded model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import ngram_cpp
from dart_core import ARDrafter, GenerationParams, complete
from dart_core.drafters.dart import DartDrafter, DartParams, load_dart_drafter
from dart_core.drafters.head import load_head
from dart_core.tools.training import dart_anchor_logits, new_head_from_target

from support import EMBEDDED_DART_HEAD, EMBEDDED_NGRAM, TINY_VOCAB, build_tiny_checkpoint, committed_asset, on_every_build, tiny_target

D = 3
VD = 64  # draft vocabulary smaller than the target's, so d2t is exercised


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return tiny_target(build_tiny_checkpoint(tmp_path_factory.mktemp("q3"), "qwen3", seed=1))


def random_head(target, seed=0, draft_length=D, vd=VD):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(target.vocab_size, generator=g)[:vd].sort().values
    head = new_head_from_target(target, ids, draft_length, seed)
    with torch.no_grad():  # a random but not tiny head, so rows differ visibly
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return head.eval()


def test_checkpoint_round_trip(qwen3, tmp_path):
    head = random_head(qwen3)
    head.save(tmp_path / "h", dtype=torch.float32)
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["draft_length"] == D and cfg["draft_vocab_size"] == VD and cfg["target_hidden_size"] == qwen3.hidden_size
    keys = set(load_file(str(tmp_path / "h" / "model.safetensors")))
    assert {"fc.weight", "midlayer.mask_rep", "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= keys
    loaded = load_head(tmp_path / "h", dart=True, target=qwen3)
    for k, v in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)


def corrupt(src, dst, fn, cfg_fn=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg_fn(cfg) if cfg_fn else cfg))
    state = load_file(str(src / "model.safetensors"))
    fn(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


def test_bad_checkpoints_are_refused(qwen3, tmp_path, tiny_llama):
    random_head(qwen3).save(tmp_path / "ok")
    ok = tmp_path / "ok"
    cases = [
        (corrupt(ok, tmp_path / "missing", lambda s: s.pop("midlayer.mask_rep")), "missing \\['midlayer.mask_rep'\\]"),
        (corrupt(ok, tmp_path / "extra", lambda s: s.update(bogus=torch.zeros(1))), "unexpected \\['bogus'\\]"),
        (corrupt(ok, tmp_path / "shape", lambda s: s.update({"fc.weight": torch.zeros(3, 3)})), "fc.weight has shape"),
        (corrupt(ok, tmp_path / "vocab", lambda s: None, lambda c: {**c, "vocab_size": 1000}), "vocabulary of 1000"),
        (corrupt(ok, tmp_path / "noD", lambda s: None, lambda c: {k: v for k, v in c.items() if k != "draft_length"}), "not a DART head"),
        (corrupt(ok, tmp_path / "d2t", lambda s: s.update(d2t=s["d2t"] + 10**6)), "d2t maps"),
    ]
    for path, match in cases:
        with pytest.raises(ValueError, match=match):
            load_head(path, dart=True, target=qwen3)
    other = tiny_target(build_tiny_checkpoint(tmp_path / "wide", "llama", vocab=TINY_VOCAB + 8))
    with pytest.raises(ValueError, match="vocabulary"):
        load_head(ok, dart=True, target=other)
    with pytest.raises(FileNotFoundError):
        load_head(tmp_path / "nothing-here", dart=True, target=qwen3)


def test_training_forward_equals_inference(qwen3):
    """The prefix-packed training forward gives, for every anchor, the logits the drafter computes
    at inference after committing the same prefix (fp32)."""
    head = random_head(qwen3, seed=3)
    tokens = torch.tensor([5, 9, 17, 33, 2, 40, 41, 7, 8, 60, 61, 11])
    out = qwen3.model(tokens, torch.arange(len(tokens)), qwen3.new_cache(32), capture=True)
    embed = qwen3.model.tok_embeddings.weight
    anchors = torch.tensor([0, 3, 4, 9])
    with torch.no_grad():
        train_logits = dart_anchor_logits(head, embed, tokens, out.hidden.clone(), anchors)
    drafter = DartDrafter(head, qwen3, None)
    for i, a in enumerate(anchors.tolist()):
        # inference: commit tokens 0..a in two chunks (prefill, then a step), root = token a+1
        session = drafter.new_session(32)
        cut = max(1, a // 2 + 1)
        session.extend(tokens[:cut].tolist(), out.hidden[:cut])
        if cut <= a:
            session.draft_logits(int(tokens[cut]))  # a step's forward, as the loop does before committing more
            session.extend(tokens[cut : a + 1].tolist(), out.hidden[cut : a + 1])
        infer = session.draft_logits(int(tokens[a + 1]))
        torch.testing.assert_close(train_logits[i], infer, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_forward_matches_the_eager_head(qwen3, dtype):
    """The drafter's forward on the CPU kernels (KernelHead) against the eager module, over two
    steps (the second attends to the first's cached keys)."""
    from dart_core import kernels

    if not kernels.AVAILABLE:
        pytest.skip("CPU kernels not built")
    target = tiny_target(qwen3.model_dir, dtype)
    head = random_head(qwen3, seed=3).to(dtype)
    tokens = torch.tensor([5, 9, 17, 33, 2, 40, 41, 7, 8, 60])
    hidden = target.model(tokens, torch.arange(len(tokens)), target.new_cache(32), capture=True).hidden
    fast, eager = DartDrafter(head, target, None), DartDrafter(head, target, None, use_kernels=False)
    assert fast.fast is not None and eager.fast is None
    results = []
    for d in (fast, eager):
        session = d.new_session(32)
        session.extend(tokens[:5].tolist(), hidden[:5])
        first = session.draft_logits(int(tokens[5]))
        session.extend(tokens[5:8].tolist(), hidden[5:8])
        results.append((first, session.draft_logits(int(tokens[8]), 3)))
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for a, b in zip(*results):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8", [False, True])
def test_one_call_draft_is_the_per_op_kernel_forward(qwen3, dtype, int8):
    """KernelHead.draft (the DART forward as one C++ call) gives the bits of its per-op methods
    (inputs, the mask rows, layer, logits) on the same kernels, two steps in a row (the second
    attends to the first's cached keys), and writes the same cache entries."""
    from dart_core import kernels
    from dart_core.drafters.head import KernelHead
    from dart_core.model import KVCache

    if not kernels.AVAILABLE:
        pytest.skip("CPU kernels not built")
    head = random_head(qwen3, seed=4).to(dtype)
    fast = KernelHead(head, int8=int8)
    c, H = head.config, head.config.hidden_size
    g = torch.Generator().manual_seed(6)
    caches = [KVCache(1, c.num_key_value_heads, c.head_dim, 32, dtype, "cpu") for _ in range(2)]
    for S, masks in ((3, 2), (2, D)):
        aux = torch.randn(S, 3 * H, generator=g).to(dtype)
        emb = torch.randn(S, H, generator=g).to(dtype)
        one = fast.draft(aux, emb, caches[0], masks)
        u, residual = fast.inputs(aux, emb)
        u = torch.cat((u, head.midlayer.mask_rep.expand(masks, -1)))
        residual = torch.cat((residual, head.midlayer.mask_rep[:H].expand(masks, -1)))
        per_op = fast.logits(fast.layer(u, residual, caches[1], keep=masks + 1))
        assert one.shape == (masks + 1, c.draft_vocab_size) and torch.equal(one, per_op)
        end = caches[0].length + S + masks  # the slots written (the rest of the cache is uninitialised)
        assert torch.equal(caches[0].k[..., :end, :], caches[1].k[..., :end, :])
        assert torch.equal(caches[0].v[..., :end, :], caches[1].v[..., :end, :])
        for cache in caches:
            cache.commit(S)
    with pytest.raises(ValueError, match="aux"):
        fast.draft(torch.zeros(2, H, dtype=dtype), torch.zeros(2, H, dtype=dtype), caches[0], 1)


def test_int8_kernel_head_is_close_to_the_eager_head(qwen3):
    """Beside GGUF targets the head's kernel forward reads Q8_0 copies of its weights against int8
    activations (KernelHead(int8=True)): not exact, within int8 rounding of the eager forward."""
    from dart_core import kernels
    from dart_core.drafters.head import KernelHead

    if not kernels.AVAILABLE:
        pytest.skip("CPU kernels not built")
    target = tiny_target(qwen3.model_dir, torch.float32)
    head = random_head(qwen3, seed=3)
    tokens = torch.tensor([5, 9, 17, 33, 2, 40, 41, 7, 8, 60])
    hidden = target.model(tokens, torch.arange(len(tokens)), target.new_cache(32), capture=True).hidden
    int8 = KernelHead(head, int8=True)
    assert isinstance(int8.lm_head, kernels.BlockWeight) and int8.lm_head.activations == "int8"
    for w in (int8.fc, int8.wqkv, int8.wo, int8.wgu, int8.wdown, int8.lm_head):  # interleaved where 16 rows divide
        assert w.layout == ("x16" if w.rows % 16 == 0 else "gguf")
    fast, eager = DartDrafter(head, target, None, kernel_head=int8), DartDrafter(head, target, None, use_kernels=False)
    out = []
    for d in (fast, eager):
        session = d.new_session(32)
        session.extend(tokens[:5].tolist(), hidden[:5])
        out.append(session.draft_logits(int(tokens[5])))
    a, b = out
    assert not torch.equal(a, b)  # it does run on the quantized copies
    assert ((a - b).norm() / b.norm()).item() < 0.05


def test_fewer_rows_are_the_first_rows_of_the_full_forward(qwen3):
    """A small tree needs only the head's first rows: running fewer mask slots gives those rows as
    the full forward does (slots attend only to earlier positions), and the same tree."""
    head = random_head(qwen3, seed=3)
    tokens = torch.tensor([5, 9, 17, 33, 2, 40, 41, 7])
    out = qwen3.model(tokens, torch.arange(len(tokens)), qwen3.new_cache(32), capture=True)
    drafter = DartDrafter(head, qwen3, None, DartParams(ngram_cpp.PruneParams(top_k=6, beam_width=6, max_nodes=3)))
    D = head.config.draft_length

    def session_after_prefix():
        session = drafter.new_session(32)
        session.extend(tokens[:6].tolist(), out.hidden[:6])
        return session

    full = session_after_prefix().draft_logits(int(tokens[6]))
    assert full.shape[0] == D + 1
    for rows in range(1, D + 2):
        torch.testing.assert_close(session_after_prefix().draft_logits(int(tokens[6]), rows), full[:rows], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="rows"):
        session_after_prefix().draft_logits(int(tokens[6]), D + 2)
    proposal = session_after_prefix().propose(int(tokens[6]), drafter.max_nodes)  # the loop's budget: the drafter's 3 nodes
    assert len(proposal.info["topk_tokens"]) == 3  # a 3-node tree: three rows drafted
    vals, idx = full[:, :].float().topk(6, dim=-1)
    whole = ngram_cpp.prune(
        head.to_target_ids(idx).numpy(), vals.softmax(-1).numpy(), int(tokens[6]), tokens[:6].tolist(), None, drafter.params.prune
    )
    assert proposal.tree.tokens.tolist() == whole.tokens.tolist() and proposal.tree.parents.tolist() == whole.parents.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_proposals_are_the_whole_prune_of_the_float_top_k(qwen3, dtype):
    """propose ranks the head's logits in their own dtype, maps ids on the host, prunes through the bound
    Pruner and takes its nodes as the tree: bit for bit the candidates and tree of the float top-k,
    ngram_cpp.prune and DraftTree.from_parents, step after step, with a trie and the context n-gram."""
    from dataclasses import replace

    from dart_core.tree import DraftTree
    from ngram_cpp import FROM_CONTEXT, HEAD_AND_CONTEXT

    head = random_head(qwen3, seed=3).to(dtype)
    trie = ngram_cpp.build([[(7 * i + j) % TINY_VOCAB for j in range(40)] for i in range(20)], TINY_VOCAB)
    params = ngram_cpp.PruneParams(top_k=6, beam_width=6, max_nodes=7, context_weight=0.6, context_extend=2)
    drafter = DartDrafter(head, qwen3, trie, DartParams(params))
    tokens = torch.tensor([5, 9, 17, 33, 2, 40, 41, 7, 5, 9, 17, 33, 2, 40, 41, 7, 5, 9, 60, 61])
    hidden = qwen3.model(tokens, torch.arange(len(tokens)), qwen3.new_cache(64), capture=True).hidden
    fast, ref = drafter.new_session(64), drafter.new_session(64)
    for s in (fast, ref):
        s.extend(tokens[:4].tolist(), hidden[:4])
    sources = set()
    for i, nodes in zip(range(4, len(tokens) - 1), (1, 3, 7) * 6):
        root = int(tokens[i])
        proposal = fast.propose(root, nodes)
        sources.update(proposal.info["sources"])
        rows = min(head.config.draft_length + 1, nodes)
        vals, idx = ref.draft_logits(root, rows).float().topk(6, dim=-1)
        cands, probs = head.to_target_ids(idx).numpy(), vals.softmax(-1).numpy()
        pruned = ngram_cpp.prune(cands, probs, root, ref.committed, trie, replace(params, max_nodes=nodes), drafter.eos_id, ref.index)
        want = DraftTree.from_parents(pruned.tokens, pruned.parents, pruned.scores)
        for field in ("tokens", "parents", "depths", "scores"):
            got, exp = getattr(proposal.tree, field), getattr(want, field)
            assert got.dtype == exp.dtype and torch.equal(got, exp), field
        assert proposal.info == {"topk_tokens": cands.tolist(), "topk_probs": probs.tolist(), "sources": pruned.sources.tolist()}
        for s in (fast, ref):
            s.extend(tokens[i : i + 1].tolist(), hidden[i : i + 1])
    assert sources & {FROM_CONTEXT, HEAD_AND_CONTEXT}  # the context n-gram took part


def test_cpu_top_k_ranks_every_dtype_as_float():
    """What draft_candidates relies on to skip the float copy of a low-precision head's logits: torch's
    CPU topk ranks bfloat16 and float16 in float32, so the same indices, in the same order, as on a float
    copy (ties included), and the same values."""
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        x = torch.randn(1 + trial % 9, 8192, generator=g) if trial % 2 else torch.randint(0, 12, (1 + trial % 9, 8192), generator=g)
        for dtype in (torch.bfloat16, torch.float16):
            low = x.to(dtype)
            for k in (6, 10, 25, 200):  # a partial sort under 64k <= n, a selection above
                v, i = low.topk(k, dim=-1)
                fv, fi = low.float().topk(k, dim=-1)
                assert torch.equal(i, fi) and torch.equal(v.float(), fv)


@pytest.mark.parametrize("use_ngram", [False, True])
def test_dart_greedy_equals_ar(tiny_ckpt, use_ngram):
    _, path = tiny_ckpt
    target = tiny_target(path)
    head = random_head(target, seed=5)
    trie = ngram_cpp.build([[(7 * i + j) % TINY_VOCAB for j in range(40)] for i in range(20)], TINY_VOCAB) if use_ngram else None
    drafter = DartDrafter(head, target, trie, DartParams(ngram_cpp.PruneParams(top_k=8, beam_width=4, max_nodes=12)))
    floored = drafter.with_params(DartParams(ngram_cpp.PruneParams(top_k=8, beam_width=4, max_nodes=12, min_score=-1.0, min_nodes=2)))
    for prompt in ([5, 6, 7], [60], [11, 40, 12, 90, 4, 4, 4, 17]):
        ar = complete(target, prompt, ARDrafter(), GenerationParams(30))
        for d in (drafter, floored):
            s = complete(target, prompt, d, GenerationParams(30))
            assert s.output_ids == ar.output_ids
            assert len(s.accepted) == s.steps - 1


def test_sessions_reuse_the_last_sessions_head_cache(qwen3):
    """A DART session takes the head cache the drafter's last closed session gave back when it fits
    (on a GPU with the head's forward captured on it, head_graph.py), never one another session holds;
    the loop closes its session; a drafter with other tree parameters shares the head and its caches."""
    drafter = DartDrafter(random_head(qwen3, seed=5), qwen3, None, DartParams(ngram_cpp.PruneParams(top_k=8, max_nodes=12)))
    s1 = drafter.new_session(40)
    cache = s1.cache
    s1.close()
    s1.close()  # once only
    s2 = drafter.new_session(30)
    s3 = drafter.new_session(30)
    assert s2.cache is cache and s3.cache is not cache
    s2.close()
    s3.close()  # the smaller one is not kept over the larger
    assert drafter.spare._idle is cache
    assert drafter.new_session(500).cache.capacity >= 500
    ar = complete(qwen3, [5, 6, 7], ARDrafter(), GenerationParams(20)).output_ids
    other = drafter.with_params(DartParams(ngram_cpp.PruneParams(top_k=4, max_nodes=5)))
    assert other.spare is drafter.spare
    for d in (drafter, other, drafter):
        assert complete(qwen3, [5, 6, 7], d, GenerationParams(20)).output_ids == ar
        assert drafter.spare._idle is cache  # given back by the loop, taken again by the next


def test_fitted_ranking_and_adaptive_trees_are_lossless(tiny_llama):
    """Trees ranked by a (random) fitted acceptance model, fixed-size and adaptive, change only what is
    drafted: greedy output equals AR's."""
    import random as _random

    from ngram_cpp.reference import ACCEPTANCE_FEATURES

    rng = _random.Random(3)
    weights = tuple(rng.uniform(-1, 1) for _ in range(3 * ACCEPTANCE_FEATURES))
    head = random_head(tiny_llama, seed=5)
    trie = ngram_cpp.build([[(7 * i + j) % TINY_VOCAB for j in range(40)] for i in range(20)], TINY_VOCAB)
    fitted = ngram_cpp.PruneParams(top_k=8, beam_width=4, max_nodes=12, context_weight=0.5, context_extend=2, acceptance=weights)
    adaptive = ngram_cpp.PruneParams(**{**fitted.__dict__, "row_costs": tuple(1.0 + 0.2 * r for r in range(14))})
    for params in (fitted, adaptive):
        drafter = DartDrafter(head, tiny_llama, trie, DartParams(params))
        for prompt in ([5, 6, 7], [11, 40, 12, 90, 4, 4, 4, 17]):
            ar = complete(tiny_llama, prompt, ARDrafter(), GenerationParams(30))
            s = complete(tiny_llama, prompt, drafter, GenerationParams(30))
            assert s.output_ids == ar.output_ids


@pytest.mark.slow
def test_embedded_dart_head_is_lossless(embedded_target):
    """The committed embedded head + trie: greedy output equals AR's (fp32)."""
    head = committed_asset(EMBEDDED_DART_HEAD / "config.json").parent
    drafter = load_dart_drafter(head, embedded_target, committed_asset(EMBEDDED_NGRAM))
    ids = embedded_target.encode("List three uses of a paperclip.")
    ar = complete(embedded_target, ids, ARDrafter(), GenerationParams(32))
    s = complete(embedded_target, ids, drafter, GenerationParams(32))
    assert s.output_ids == ar.output_ids


@pytest.mark.slow
def test_embedded_fitted_ranking_and_adaptive_size(embedded_target, tmp_path, monkeypatch):
    """The embedded head's fitted ranking (assets/dart/acceptance.json) is the registry's default, and
    with --adaptive-tree the tree size follows this machine's costs: both lossless (fp32)."""
    from dart_core.drafters.config import DartConfig
    from dart_core.drafters.registry import build_drafter
    from dart_core.tools import calibrate

    committed_asset(EMBEDDED_DART_HEAD / "acceptance.json")
    monkeypatch.setattr(calibrate.measure, "calibration_dir", lambda: tmp_path)  # a fresh timing, not the machine's cache
    monkeypatch.setattr(calibrate.measure, "REPEATS", 1)
    monkeypatch.setattr(calibrate.measure, "SETTLE_S", 0.0)
    fitted = build_drafter("dart", embedded_target, DartConfig.embedded(max_nodes=8))
    assert fitted.params.prune.acceptance and not fitted.params.prune.row_costs
    score = build_drafter("dart", embedded_target, DartConfig.embedded(max_nodes=8, ranking="score"))
    assert not score.params.prune.acceptance
    adaptive = calibrate.build_measured("dart", embedded_target, DartConfig.embedded(max_nodes=8, adaptive=True))
    assert len(adaptive.params.prune.row_costs) == calibrate.measure.MAX_CALIBRATED_ROWS
    ids = embedded_target.encode("List three uses of a paperclip.")
    ar = complete(embedded_target, ids, ARDrafter(), GenerationParams(32))
    for d in (fitted, adaptive):
        s = complete(embedded_target, ids, d, GenerationParams(32))
        assert s.output_ids == ar.output_ids


def test_draft_depth_limits_the_tree(tiny_llama):
    head = random_head(tiny_llama, seed=7)
    drafter = DartDrafter(head, tiny_llama, None, DartParams(ngram_cpp.PruneParams(top_k=4, beam_width=4, max_nodes=12), depth=2))
    session = drafter.new_session(64)
    prompt = [5, 6, 7, 8]
    out = tiny_llama.prefill(prompt, tiny_llama.new_cache(64), capture=True)
    session.extend(prompt, out.hidden)
    proposal = session.propose(9, drafter.max_nodes)
    assert int(proposal.tree.depths.max()) <= 2 and len(proposal.info["topk_tokens"]) == 2
    ar = complete(tiny_llama, prompt, ARDrafter(), GenerationParams(20))
    assert complete(tiny_llama, prompt, drafter, GenerationParams(20)).output_ids == ar.output_ids
    with pytest.raises(ValueError, match="depth"):
        DartDrafter(head, tiny_llama, None, DartParams(depth=0))


def test_int8_head_beside_bf16_targets_only_without_bf16_arithmetic():
    """The head's kernel forward reads Q8_0 weights beside GGUF targets, and beside bf16 targets on the
    builds that widen bf16 to fp32 (all but avx512bf16); beside fp32 targets it keeps its weights."""
    from types import SimpleNamespace

    from dart_core.drafters.head import int8_beside

    def choices():
        return tuple(
            int8_beside(SimpleNamespace(weights=w, dtype=d))
            for w, d in (("bfloat16", torch.bfloat16), ("gguf-int16", torch.float32), ("float32", torch.float32))
        )

    for path, got in on_every_build(choices).items():
        assert got == (path != "avx512bf16", True, False), path
