"""Where a draft head's captured forwards run (dart_core/cuda/head_graph.py, expand_graph.py): the CUDA
package imported only where the device, or a demand, needs it (fixed_shape.cuda_asked), so a CPU
session reads nothing of it."""

from __future__ import annotations

from ..fixed_shape import cuda_asked


def captured_head(drafter, flag: str):
    """The module of a draft head's captured forwards (dart_core.cuda.head_graph) where a session of
    `drafter` (DART's or EAGLE3's) runs the one its attribute `flag` asks for (head_graph.wanted: None
    where it runs, False never, True demanded), else None; the CUDA package is imported only where
    cuda_asked says the device or the demand needs it."""
    if not cuda_asked(drafter.target.device, getattr(drafter, flag)):
        return None
    from ..cuda import head_graph

    return head_graph if head_graph.wanted(drafter, flag) else None
