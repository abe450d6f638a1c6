"""The app's tree size per request: each drafter is built once at the largest size a visitor may ask
for, a request names any size up to it (the page's sliders, the API's tree_size), and a drafter asked
for a smaller tree drafts exactly the trees of one built at that size. Bad sizes are refused with
the reason, and the slider's range never leaves the exact path."""

from __future__ import annotations

import pytest

from app.engine import Engine, RequestError
from app.launch import APP_MAX_NODES, largest_tree, sizes_for_requests
from dart_core.cli.options import drafter_args, drafter_configs
from dart_core.drafters.registry import build_drafter

from support import ROOT, committed_asset, tiny_target

MESSAGES = [{"role": "user", "content": "Write two sentences about a lighthouse."}]
TOKENS = 40


def built(target, method: str, nodes: int):
    committed_asset(ROOT / "assets" / method / "config.json")
    return build_drafter(method, target, drafter_configs(drafter_args(max_nodes=nodes, eagle3_max_nodes=nodes), True)[method])


def trees(run) -> list[tuple[list[int], list[int]]]:
    return [(s.tree.tokens.tolist(), s.tree.parents.tolist()) for s in run.steps if s.tree is not None]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dart", "eagle3"])
def test_a_smaller_tree_asked_of_a_big_drafter_is_the_drafter_built_at_that_size(embedded_bf16, method):
    big = Engine(embedded_bf16, {method: built(embedded_bf16, method, 12)}, TOKENS, default_sizes={method: 3})
    assert big.tree_sizes[method].default == 3 and big.tree_sizes[method].maximum == 12
    for n in (3, 7):
        small = Engine(embedded_bf16, {method: built(embedded_bf16, method, n)}, TOKENS)
        a = big.complete(big.request(MESSAGES, method, TOKENS, 0.0, 1.0, 0, None if n == 3 else {method: n}))
        b = small.complete(small.request(MESSAGES, method, TOKENS, 0.0, 1.0, 0))
        assert a.tree_size == b.tree_size == n and a.label.endswith(f"(≤{n} nodes)")
        assert trees(a) == trees(b) and a.output_ids == b.output_ids
        assert max(len(t) - 1 for t, _ in trees(a)) <= n
    ar = big.complete(big.request(MESSAGES, "ar", TOKENS, 0.0, 1.0, 0))
    assert ar.tree_size is None and ar.label == "AR"


def test_bad_tree_sizes_are_refused_with_the_reason(embedded_bf16):
    engine = Engine(embedded_bf16, {"dart": built(embedded_bf16, "dart", 6)}, TOKENS, default_sizes={"dart": 2})
    ok = engine.request(MESSAGES, "ar", 4, 0.0, 1.0, 0, {"dart": 6})
    assert ok.params.max_nodes is None and ok.for_method("dart").params.max_nodes == 6  # compare mode's DART run
    for sizes, reason in [
        ({"dart": -1}, "between 0 and 6"),
        ({"dart": 7}, "between 0 and 6"),
        ({"dart": 2.5}, "must be an integer"),
        ({"dart": True}, "must be an integer"),
        ({"ar": 2}, "drafts no tree"),
        ({"eagle3": 2}, "drafts no tree"),  # not loaded here
        ([4], "by method"),
    ]:
        with pytest.raises(RequestError, match=reason):
            engine.request(MESSAGES, "dart", 4, 0.0, 1.0, 0, sizes)
    with pytest.raises(ValueError, match="default tree size 9"):
        Engine(embedded_bf16, {"dart": built(embedded_bf16, "dart", 6)}, TOKENS, default_sizes={"dart": 9})
    # --max-nodes 0 (no drafted node) is a default the app serves: plain decoding's steps through DART's loop
    zero = Engine(embedded_bf16, {"dart": built(embedded_bf16, "dart", 6)}, TOKENS, default_sizes={"dart": 0})
    run = zero.complete(zero.request(MESSAGES, "dart", 8, 0.0, 1.0, 0))
    assert run.tree_size == 0 and run.tau == 1.0


def test_the_largest_tree_stays_on_the_exact_path(embedded_bf16, tiny_llama):
    from dart_core import kernels

    if kernels.AVAILABLE:  # the CPU kernels are exact at any size: the device's largest
        assert embedded_bf16.exact_verify(APP_MAX_NODES["cpu"] + 1)
        assert largest_tree(embedded_bf16, 3) == APP_MAX_NODES["cpu"]
    assert largest_tree(embedded_bf16, 50) == 50  # a default above it is kept
    tiny = tiny_target(tiny_llama.model_dir)
    tiny.model.use_kernels = False  # --eager: the fixed-shape forward, exact up to its rows
    eager = tiny.model.fixed_row_count(tiny.device)
    assert tiny.exact_verify(eager) and not tiny.exact_verify(eager + 1)
    assert largest_tree(tiny, 4) == eager - 1
    assert largest_tree(tiny, eager + 5) == max(eager + 5, APP_MAX_NODES["cpu"])  # not exact at its default: the plain limit


def test_the_app_builds_drafters_at_the_largest_size_and_keeps_the_defaults(embedded_bf16):
    configs = drafter_configs(drafter_args(max_nodes=3, eagle3_max_nodes=5), True)
    built_configs, defaults = sizes_for_requests(configs, embedded_bf16)
    assert defaults == {"dart": 3, "eagle3": 5}
    assert built_configs.dart.max_nodes == largest_tree(embedded_bf16, 3) and built_configs.eagle3.max_nodes == largest_tree(
        embedded_bf16, 5
    )
    assert built_configs.dart.head == configs.dart.head and built_configs.dart.weights == configs.dart.weights
