"""CUDA graph capture and replay, simulated on a CPU: what a captured forward would do on a GPU that the
CPU otherwise never shows.

A CUDA graph records a body's kernels once, with their arguments, and each replay runs exactly those
kernels on exactly those addresses with exactly those scalars. The engine's captured forwards
(fixed_shape.FixedRunner, cuda/head_graph.py, cuda/expand_graph.py) are written so that a step's
inputs reach the body only through static device buffers. Where one does not, the GPU silently
computes with the capture's values (a cache length read as a Python int, a buffer rebound to a new
tensor, a tensor built from host data) or the capture fails (an op that waits for the device: `.item()`,
`nonzero`, a boolean index). None of that shows on a CPU, where the bodies run uncaptured each call.

`simulated()` makes the engine capture on the CPU (fixed_shape.graphs_here true, cuda.forward.capture_graph this
module's). A "capture" runs the body twice as the real warm-up does, then once recording every torch op
(through a TorchDispatchMode) and every Triton launch (in Triton's interpreter) with their arguments:
a tensor by its storage (a static buffer by address, one the body made by the op that made it), its
offset, shape, stride and dtype; anything else by value. Ops that would wait for the device or put host
data into the graph fail the capture. Each replay runs the body again, recording, and must give the
same record; its outputs are then copied into the capture's, which the engine holds as a graph's
static outputs. So a replay here computes what the real graph would, and a record that differs (the
first difference is in the error) is a forward that would replay stale inputs on a GPU.

What it cannot see: ops the body runs outside torch and Triton, and the GPU's own instructions; and a
real capture does not run the body, where this one does (the bodies' writes are idempotent: the same
keys to the same cache slots).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# ops that wait for the device (a capture fails on them) or put host data into the graph (a replay would
# reuse the capture's values): by their overload packet's name
SYNCING = {
    "_local_scalar_dense": "reads a tensor's value on the host (.item(), .tolist(), bool(), int())",
    "item": "reads a tensor's value on the host",
    "is_nonzero": "reads a tensor's value on the host (bool())",
    "equal": "reads the comparison's result on the host",
    "nonzero": "an output shape that depends on values: waits for the device",
    "masked_select": "an output shape that depends on values: waits for the device",
    "unique": "an output shape that depends on values",
    "_unique2": "an output shape that depends on values",
    "unique_consecutive": "an output shape that depends on values",
    "unique_dim": "an output shape that depends on values",
    "lift_fresh": "a tensor made from host data inside the body: a graph keeps the capture's values",
    "lift_fresh_copy": "a tensor made from host data inside the body: a graph keeps the capture's values",
}
RANDOM = ("random_", "uniform_", "normal_", "bernoulli", "exponential_", "multinomial", "randperm", "rand", "randn", "randint")


class GraphCaptureError(RuntimeError):
    """The body does something a CUDA graph cannot capture."""


class GraphReplayError(AssertionError):
    """A replay's record differs from the capture's: on a GPU the graph would compute with the capture's inputs."""


@dataclass
class Stats:
    captures: int = 0
    replays: int = 0
    ops: list[int] = field(default_factory=list)  # each capture's recorded torch ops and Triton launches
    names: list[str] = field(default_factory=list)  # each capture's body (qualified name)


class _Record(TorchDispatchMode):
    """The ops of one body call, each with its arguments' signatures (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.entries: list[tuple] = []
        self.made: dict[int, tuple] = {}  # storage address -> ("made", entry, output) for storages the body made
        self.paused = 0  # inside a Triton launch: the interpreter's own tensor ops are not the body's

    def sig(self, x):
        if isinstance(x, torch.Tensor):
            ptr = x.untyped_storage().data_ptr()
            return ("tensor", self.made.get(ptr, ("static", ptr)), x.storage_offset(), tuple(x.shape), tuple(x.stride()), str(x.dtype))
        if isinstance(x, (list, tuple)):
            return tuple(self.sig(v) for v in x)
        if isinstance(x, dict):
            return tuple((k, self.sig(v)) for k, v in sorted(x.items()))
        if isinstance(x, float):
            return ("float", repr(x))
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return str(x)
        if callable(x):
            return ("callable", getattr(x, "__qualname__", repr(x)))
        return (type(x).__name__, repr(x))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in SYNCING:
            raise GraphCaptureError(f"{func} inside a captured body: {SYNCING[name]}")
        if name in RANDOM:
            raise GraphCaptureError(f"{func} inside a captured body: a replay repeats the capture's random draws")
        if name == "index" or name.startswith("index_put"):
            for t in tree_flatten(args[1])[0]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.bool:
                    raise GraphCaptureError(f"{func} with a boolean index inside a captured body: waits for the device")
        entry = len(self.entries)
        self.entries.append((str(func), self.sig(args), self.sig(kwargs)))
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for j, t in enumerate(tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in inputs:  # a new storage (a view or an in-place op keeps its input's)
                    self.made[ptr] = ("made", entry, j)
        return out

    def launch(self, name: str, grid, args, kwargs) -> None:
        """A Triton kernel launch, recorded by the interpreter's patched run."""
        self.entries.append(("triton " + name, self.sig(grid if not callable(grid) else ("grid", grid)), self.sig(args), self.sig(kwargs)))


_RECORDING: list[_Record] = []


class SimulatedGraph:
    """A body captured: its record and its outputs (static: each replay's outputs are copied into them)."""

    def __init__(self, body, stats: Stats):
        self.body, self.stats = body, stats
        self.name = getattr(body, "__qualname__", repr(body))
        self.replays = 0
        self.record, self.outputs = self._run()
        stats.captures += 1
        stats.ops.append(len(self.record))
        stats.names.append(self.name)

    def _run(self):
        rec = _Record()
        _RECORDING.append(rec)
        try:
            with rec:
                out = self.body()
        finally:
            _RECORDING.pop()
        return rec.entries, out

    def replay(self) -> None:
        record, out = self._run()
        if record != self.record:
            at = next((i for i, (a, b) in enumerate(zip(record, self.record)) if a != b), min(len(record), len(self.record)))
            captured = self.record[at] if at < len(self.record) else "(the capture ended here)"
            replayed = record[at] if at < len(record) else "(the replay ended here)"
            raise GraphReplayError(
                f"replay {self.replays + 1} of {self.name} differs from its "
                f"capture at op {at} of {len(self.record)}:\n  captured: {captured}\n  replayed: {replayed}"
            )
        for static, new in zip(tree_flatten(self.outputs)[0], tree_flatten(out)[0]):
            if isinstance(static, torch.Tensor):
                static.copy_(new)
        self.replays += 1
        self.stats.replays += 1


def _triton_run(original):
    def run(self, *args, grid, warmup, **kwargs):
        rec = _RECORDING[-1] if _RECORDING else None
        if rec is None or warmup:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        rec.launch(self.__name__, grid, args, kwargs)
        rec.paused += 1
        try:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            rec.paused -= 1

    return run


@contextlib.contextmanager
def simulated():
    """Within it, the engine's captured forwards capture and replay as above on any device; yields the
    Stats of every capture and replay."""
    from dart_core import fixed_shape
    from dart_core.cuda import forward

    stats = Stats()

    def capture_graph(body, device):
        for _ in range(2):  # the real capture's warm-up
            body()
        graph = SimulatedGraph(body, stats)
        return graph, graph.outputs

    saved = (fixed_shape.graphs_here, forward.capture_graph)
    fixed_shape.graphs_here, forward.capture_graph = (lambda device: True), capture_graph
    interpreter = None
    if forward.triton_interpreting() and forward.triton_available():
        from triton.runtime import interpreter

        original = interpreter.InterpretedFunction.run
        interpreter.InterpretedFunction.run = _triton_run(original)
    try:
        yield stats
    finally:
        fixed_shape.graphs_here, forward.capture_graph = saved
        if interpreter is not None:
            interpreter.InterpretedFunction.run = original
