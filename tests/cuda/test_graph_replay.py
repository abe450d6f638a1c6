"""The CPU simulation of CUDA graph capture and replay (tests/cuda/graph_replay.py) catches what a graph
would get wrong on a GPU: a body that reads its step's inputs from anywhere but static buffers, and a
body a capture refuses. The engine's own captured forwards run under it in Triton's interpreter
(tests/cuda/triton_interpreted.py, asserted in tests/cuda/test_triton_kernels.py)."""

from __future__ import annotations

import pytest
import torch
from graph_replay import GraphCaptureError, GraphReplayError, simulated

from dart_core import fixed_shape
from dart_core.cuda import forward

CPU = torch.device("cpu")


def test_the_engine_captures_only_on_cuda_outside_the_simulation():
    assert not fixed_shape.graphs_here(CPU) and fixed_shape.graphs_here(torch.device("cuda"))
    with simulated():
        assert fixed_shape.graphs_here(CPU)
    assert not fixed_shape.graphs_here(CPU)


def test_a_body_on_static_buffers_replays_into_its_static_outputs():
    a, b = torch.arange(4.0), torch.ones(4)
    with simulated() as stats:
        graph, out = forward.capture_graph(lambda: (a * 2 + b, a.sum()), CPU)
        for step in range(3):
            a.copy_(torch.full((4,), float(step)))  # the step's input, loaded into the static buffer
            graph.replay()
            assert torch.equal(out[0], torch.full((4,), 2.0 * step + 1)) and out[1].item() == 4 * step
    assert stats.captures == 1 and stats.replays == 3 and stats.ops[0] == 3  # mul, add, sum


def test_a_python_scalar_that_changes_fails_the_replay():
    a = torch.zeros(4)
    length = [5]
    with simulated():
        graph, _ = forward.capture_graph(lambda: a + length[0], CPU)
        graph.replay()  # the same value: the same graph
        length[0] = 6  # e.g. the cache length read as an int: a GPU would keep adding 5
        with pytest.raises(GraphReplayError, match="differs from its capture at op 0") as e:
            graph.replay()
    assert "5" in str(e.value) and "6" in str(e.value)


def test_a_buffer_rebound_to_a_new_tensor_fails_the_replay():
    class Inputs:
        meta = torch.tensor([3, 1], dtype=torch.int32)

    inputs = Inputs()
    with simulated():
        graph, _ = forward.capture_graph(lambda: inputs.meta * 2, CPU)
        inputs.meta = torch.tensor([4, 1], dtype=torch.int32)  # a GPU graph would still read the first one
        with pytest.raises(GraphReplayError, match="static"):
            graph.replay()


def test_an_intermediate_is_named_by_the_op_that_made_it_not_its_address():
    a = torch.randn(64, 64)

    def body():  # temporaries freed and reallocated, wherever the allocator puts them
        x = a @ a
        y = torch.relu(x) + 1
        return (y @ a).sum(0)

    with simulated() as stats:
        graph, _ = forward.capture_graph(body, CPU)
        for _ in range(3):
            junk = [torch.empty(64, 64) for _ in range(3)]  # moves the allocator's free lists between calls
            graph.replay()
            del junk
    assert stats.replays == 3


@pytest.mark.parametrize(
    "body, reason",
    [
        (lambda a: a.sum().item(), "reads a tensor's value on the host"),
        (lambda a: a[a > 0], "boolean index"),
        (lambda a: a.nonzero(), "depends on values"),
        (lambda a: a + torch.tensor([1.0, 2.0, 3.0, 4.0]), "made from host data"),
        (lambda a: a + torch.randn(4), "random draws"),
        (lambda a: 1 if bool(a.sum() > 0) else 0, "host"),
    ],
    ids=["item", "bool-index", "nonzero", "host-tensor", "random", "branch"],
)
def test_what_a_capture_refuses_fails_the_capture(body, reason):
    a = torch.arange(4.0)
    with simulated(), pytest.raises(GraphCaptureError, match=reason):
        forward.capture_graph(lambda: body(a), CPU)


def test_the_simulation_is_undone_when_it_ends():
    original = forward.capture_graph
    with pytest.raises(RuntimeError), simulated():
        raise RuntimeError("a failing test inside it")
    assert forward.capture_graph is original and not fixed_shape.graphs_here(CPU)


def test_a_failing_replay_names_its_own_graph_and_count():
    a = torch.zeros(4)
    length = [5]

    def stale():
        return a + length[0]

    def fine():
        return a * 2

    with simulated() as stats:
        graph, _ = forward.capture_graph(stale, CPU)
        other, _ = forward.capture_graph(fine, CPU)  # captured after it: the message must not name this one
        other.replay()
        other.replay()
        length[0] = 6
        with pytest.raises(GraphReplayError, match=r"^replay 1 of .*stale differs"):
            graph.replay()
    assert stats.replays == 2 and other.replays == 2 and graph.replays == 0
