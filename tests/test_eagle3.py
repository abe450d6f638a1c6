"""EAGLE3 drafter: lossless greedy decoding with a random head, tree shape, and head-type checks."""

from __future__ import annotations

import pytest
import torch

from dart_core import ARDrafter, GenerationParams, complete
from dart_core.drafters.dart import DartDrafter
from dart_core.drafters.eagle3 import Eagle3Drafter, Eagle3Params
from dart_core.drafters.head import load_head
from dart_core.tools.training import new_head_from_target

from support import random_eagle3_head, tiny_target


def test_eagle3_greedy_equals_ar(tiny_ckpt):
    _, path = tiny_ckpt
    target = tiny_target(path)
    drafter = Eagle3Drafter(random_eagle3_head(target), target, Eagle3Params(depth=4, top_k=4, max_nodes=15))
    for prompt in ([5, 6, 7], [60], [11, 40, 12, 90, 4, 4, 4, 17]):
        ar = complete(target, prompt, ARDrafter(), GenerationParams(30))
        s = complete(target, prompt, drafter, GenerationParams(30))
        assert s.output_ids == ar.output_ids


def proposer(drafter, target, capacity: int):
    """propose(max_nodes) -> the tree a fresh session drafts after prompt 5 6 7 8, root 9."""
    ids = [5, 6, 7, 8]
    out = target.prefill(ids, target.new_cache(capacity), capture=True)

    def propose(max_nodes):
        session = drafter.new_session(capacity)
        session.extend(ids, out.hidden)
        return session.propose(9, max_nodes).tree

    return propose


def test_eagle3_tree_shape(tiny_llama):
    drafter = Eagle3Drafter(random_eagle3_head(tiny_llama, seed=2), tiny_llama, Eagle3Params(depth=3, top_k=5, max_nodes=19))
    propose = proposer(drafter, tiny_llama, 64)
    tree = propose(drafter.max_nodes)  # the loop's budget: the drafter's size when the cache has room
    assert len(tree) == 20 and tree.max_depth <= 4
    scores = tree.scores.tolist()
    assert all(scores[i] <= scores[int(tree.parents[i])] + 1e-6 for i in range(1, len(tree)))
    assert len(propose(4)) == 5  # the room in the cache caps the tree: 4 drafted nodes + the root


def test_small_trees_search_less_and_keep_the_same_nodes(tiny_llama):
    """A 5-node tree searches 4 levels with 5 candidates (not 7 with 10) and keeps the 5 best nodes
    of the full search, which a 60-node tree holds as its best five."""
    drafter = Eagle3Drafter(random_eagle3_head(tiny_llama, seed=4), tiny_llama, Eagle3Params(depth=7, top_k=10, max_nodes=59))
    propose = proposer(drafter, tiny_llama, 128)
    full = propose(59)
    sc, depth = full.scores.tolist(), full.depths.tolist()
    for nodes in (1, 3, 5):
        small = propose(nodes)
        expect = sorted(range(1, len(full)), key=lambda i: (-sc[i], depth[i], i))[:nodes]
        assert sorted(small.tokens[1:].tolist()) == sorted(full.tokens[expect].tolist())
        torch.testing.assert_close(small.scores[1:].sort().values, full.scores[expect].sort().values, atol=1e-5, rtol=0)
        assert small.max_depth <= nodes


def test_kernel_first_forward_matches_the_eager_head(tiny_llama):
    """The step's first forward on the CPU kernels gives the same trees as the eager module (fp32)."""
    from dart_core import kernels

    if not kernels.AVAILABLE:
        pytest.skip("CPU kernels not built")
    head = random_eagle3_head(tiny_llama, seed=2)
    params = Eagle3Params(depth=3, top_k=4, max_nodes=12)
    fast, eager = Eagle3Drafter(head, tiny_llama, params), Eagle3Drafter(head, tiny_llama, params, use_kernels=False)
    assert fast.fast is not None and eager.fast is None
    ids = [5, 6, 7, 8, 9, 10]
    out = tiny_llama.prefill(ids, tiny_llama.new_cache(64), capture=True)
    trees = []
    for d in (fast, eager):
        session = d.new_session(64)
        session.extend(ids[:4], out.hidden[:4])
        session.propose(ids[4], params.max_nodes)
        session.extend(ids[4:], out.hidden[4:])  # the second step attends to the first's cached keys
        trees.append(session.propose(11, params.max_nodes).tree)
    assert trees[0].tokens.tolist() == trees[1].tokens.tolist() and trees[0].parents.tolist() == trees[1].parents.tolist()
    torch.testing.assert_close(trees[0].scores, trees[1].scores, atol=1e-4, rtol=0)


def test_kernel_tree_layer_matches_the_eager_layer_with_the_ancestor_mask(tiny_llama):
    """KernelHead.tree_layer, two levels of a tree after a committed prefix (the second re-feeding the
    first's q|k|v rows), equals the eager layer run with each row's ancestor mask, and leaves the
    cache's committed length as it was."""
    from dart_core import kernels
    from dart_core.drafters.head import KernelHead
    from dart_core.model import KVCache

    if not kernels.AVAILABLE:
        pytest.skip("CPU kernels not built")
    head = random_eagle3_head(tiny_llama, seed=3)
    c, fast, H = head.config, KernelHead(head), head.config.hidden_size
    g = torch.Generator().manual_seed(7)
    committed = 5
    caches = [KVCache(1, c.num_key_value_heads, c.head_dim, 32, torch.float32, torch.device("cpu")) for _ in range(2)]
    for cache in caches:  # the same committed prefix in both
        cache.k[0, 0, :, :committed] = torch.randn(c.num_key_value_heads, committed, c.head_dim, generator=g)
        cache.v[0, 0, :, :committed] = torch.randn(c.num_key_value_heads, committed, c.head_dim, generator=g)
        g.manual_seed(7)
        cache.commit(committed)
    # level 0: two children of the root; level 1: a child of each, the second's parent is row 0
    levels = [([-1, -1], [committed] * 2), ([1, 0], [committed + 1] * 2)]
    prior, fed_parents, fed_pos = None, [], []
    for parents_new, pos_new in levels:
        hidden, emb = torch.randn(2, H, generator=g), torch.randn(2, H, generator=g)
        m = len(fed_parents)
        parents = torch.tensor(fed_parents + parents_new)
        positions = torch.tensor(fed_pos + pos_new)
        u, residual = fast.inputs_from_hidden(hidden, emb)
        out, qkv = fast.tree_layer(u, residual, caches[0], committed, positions, parents, prior)
        assert caches[0].length == committed
        prior = qkv if prior is None else torch.cat((prior, qkv))
        # eager: the new rows attend to the prefix, their ancestors among the earlier rows, and themselves
        ue, re = head.inputs(None, hidden, emb)
        anc = torch.zeros(2, m + 2, dtype=torch.bool)
        for r in range(2):
            a = m + r
            while a >= 0:
                anc[r, a] = True
                a = parents[a].item()
        mask = torch.cat((torch.ones(2, committed, dtype=torch.bool), anc), dim=1)
        cos, sin = head.rope(torch.tensor(pos_new), ue.dtype)
        h = re + head.midlayer.attention(ue, cos, sin, mask[None, None], caches[1])
        caches[1].commit(2)
        torch.testing.assert_close(out, head.midlayer.mlp_block(h), atol=1e-5, rtol=1e-5)
        fed_parents += parents_new
        fed_pos += pos_new


def test_head_types_are_not_mixed(tiny_llama, tmp_path):
    head = random_eagle3_head(tiny_llama)
    head.save(tmp_path / "e3")
    assert load_head(tmp_path / "e3", dart=False, target=tiny_llama).config.draft_length is None
    with pytest.raises(ValueError, match="not a DART head"):
        load_head(tmp_path / "e3", dart=True, target=tiny_llama)
    with pytest.raises(ValueError, match="DART head"):
        DartDrafter(head, tiny_llama, None)


def test_training_time_test_matches_drafting(tiny_llama):
    """The EAGLE3 training forward, teacher-forced on a chain, computes what drafting computes along
    that chain: with top_k=1 drafting follows its own greedy chain, and the training rows of the same
    anchor (batched with another anchor, which must not leak in) give the same tokens and log-probs."""
    from dart_core.tools.training import eagle3_anchor_logits

    K = 4
    head = random_eagle3_head(tiny_llama, seed=3)
    drafter = Eagle3Drafter(head, tiny_llama, Eagle3Params(depth=K, top_k=1, max_nodes=K + 1))
    prefix, root = [5, 6, 7, 8, 9, 10], 11
    a = len(prefix) - 1
    out = tiny_llama.prefill(prefix, tiny_llama.new_cache(64), capture=True)
    session = drafter.new_session(64)
    session.extend(prefix, out.hidden)
    tree = session.propose(root, drafter.max_nodes).tree
    chain = tree.tokens.tolist()[1:]
    assert len(chain) == K + 1 and tree.parents.tolist() == [-1] + list(range(K + 1))

    seq = torch.tensor(prefix + [root] + chain[:K])
    full = tiny_llama.model(seq, torch.arange(len(seq)), tiny_llama.new_cache(64), capture=True, final=False, logits=False)
    with torch.no_grad():
        logits = eagle3_anchor_logits(head, tiny_llama.model.tok_embeddings.weight, seq, full.hidden.clone(), torch.tensor([2, a]), K)
    assert logits.shape == (2, K + 1, head.config.draft_vocab_size)
    logp = logits[1].log_softmax(-1)
    draft_ids = (torch.arange(head.config.draft_vocab_size) + head.d2t).tolist()
    idx = [draft_ids.index(c) for c in chain]
    assert head.to_target_ids(logp.argmax(-1)).tolist() == chain
    cumulative = torch.cumsum(logp[torch.arange(K + 1), idx], 0)
    torch.testing.assert_close(cumulative, tree.scores[1:], atol=1e-4, rtol=0)


def test_angelslim_style_checkpoint_loads(tiny_llama, tmp_path):
    """EAGLE3 heads as AngelSlim/SpecForge ship them: pytorch_model.bin, a full draft vocabulary
    without d2t/t2d, extra config fields (bias) and an embed_tokens tensor that is ignored."""
    import json

    head = new_head_from_target(tiny_llama, torch.arange(tiny_llama.vocab_size), None, seed=4)
    state = {k: v for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
    state["embed_tokens.weight"] = torch.zeros(tiny_llama.vocab_size, tiny_llama.hidden_size)
    out = tmp_path / "angelslim"
    out.mkdir()
    torch.save(state, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps({**head.config.to_dict(), "bias": False}))
    loaded = load_head(out, dart=False, target=tiny_llama)
    assert loaded.d2t.eq(0).all() and loaded.t2d.all()
    torch.testing.assert_close(loaded.fc.weight, head.fc.weight)
    # a pickle that is not a plain tensor dict is refused, not executed
    (out / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        load_head(out, dart=False, target=tiny_llama)


def test_read_back_returns_each_tensor_exactly_in_one_copy():
    from dart_core.drafters.eagle3 import read_back

    vals = torch.randn(6).float()
    ids = torch.tensor([0, 151_935, 2**40])
    a, b, c = read_back(ids, vals, torch.tensor([2, 5]))
    assert a == [0.0, 151_935.0, float(2**40)] and b == vals.tolist() and c == [2.0, 5.0]


def test_rank_orders_by_score_then_depth_then_pool_order(tiny_llama):
    """The pool's ranking (numpy's lexsort) keeps the nodes a Python sort by (score descending, depth,
    pool order) keeps, ties included, and builds the same tree from them."""
    import random

    from dart_core.drafters.eagle3 import _Pool

    drafter = Eagle3Drafter(random_eagle3_head(tiny_llama, seed=1), tiny_llama, Eagle3Params(depth=4, top_k=4, max_nodes=30))
    session = drafter.new_session(64)
    rng = random.Random(0)
    for trial in range(40):
        k = rng.choice((2, 3, 4))
        own = [rng.choice((-0.25, -0.5, -1.0, -2.0)) for _ in range(k)]  # few values: many exact ties
        pool = _Pool.of_root(list(range(100, 100 + k)), own, torch.tensor(own, dtype=torch.float64))
        frontier = list(range(k))
        for _ in range(rng.randrange(1, 4)):
            base = pool.scores[frontier]
            child = [rng.choice((-0.25, -0.5, -1.0)) for _ in range(len(frontier) * k)]
            cand = (base[:, None] + torch.tensor(child, dtype=torch.float64).view(len(frontier), k)).reshape(-1)
            best = sorted(rng.sample(range(cand.numel()), k))
            frontier = pool.add_level(frontier, rng.sample(range(1000), len(child)), child, cand, best, k)
        sc = pool.scores.tolist()
        depth = [0] * len(sc)
        for i, par in enumerate(pool.parents):
            depth[i] = 1 if par < 0 else depth[par] + 1
        keep = rng.randrange(1, len(sc) + 1)
        want = sorted(sorted(range(len(sc)), key=lambda i: (-sc[i], depth[i], i))[:keep])
        tree = session.rank(7, pool, keep)
        assert tree.tokens.tolist() == [7] + [pool.tokens[i] for i in want], trial
        assert tree.scores[1:].tolist() == [pytest.approx(sc[i]) for i in want]
        index = {node: j + 1 for j, node in enumerate(want)}
        assert tree.parents.tolist() == [-1] + [index.get(pool.parents[i], 0) for i in want]
