"""The CPU engine reads without the CUDA package: a CPU generation (plain decoding, DART and EAGLE3 on a
tiny target, on the CPU kernels and on the torch fixed-shape forward that `--eager` runs) imports no
module of dart_core.cuda. Run in a fresh interpreter, so no other test's import counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import torch

    import ngram_cpp
    from dart_core import ARDrafter, GenerationParams, complete
    from dart_core.drafters.dart import DartDrafter, DartParams
    from dart_core.drafters.eagle3 import Eagle3Drafter, Eagle3Params
    from dart_core.tools.training import new_head_from_target
    from support import build_tiny_checkpoint, random_eagle3_head, tiny_target

    target = tiny_target(build_tiny_checkpoint(Path(sys.argv[1]), "llama"))
    done = {}
    for kernels in (True, False):  # the CPU kernels, then the torch fixed-shape forward (--eager)
        target.model.use_kernels = kernels
        dart_head = new_head_from_target(target, torch.arange(64), 3, 0).eval()  # a random DART head, 3 masks
        dart = DartDrafter(dart_head, target, None, DartParams(ngram_cpp.PruneParams(top_k=8, beam_width=4, max_nodes=12)))
        eagle = Eagle3Drafter(random_eagle3_head(target), target, Eagle3Params(depth=3, top_k=4, max_nodes=12))
        plain = complete(target, [5, 6, 7], ARDrafter(), GenerationParams(12)).output_ids
        for name, drafter in (("dart", dart), ("eagle3", eagle)):
            out = complete(target, [5, 6, 7], drafter, GenerationParams(12))
            done[f"{name} kernels={kernels}"] = out.output_ids == plain
        done[f"exact kernels={kernels}"] = target.model.exact(12, torch.device("cpu"))
    print(json.dumps({"cuda": sorted(m for m in sys.modules if m.startswith("dart_core.cuda")), "done": done}))
    """
)


def test_a_cpu_generation_imports_nothing_of_the_cuda_package(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "tiny")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "tests")))},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["done"] == {f"{m} kernels={k}": True for m in ("dart", "eagle3", "exact") for k in (True, False)}, result
    assert result["cuda"] == [], result
