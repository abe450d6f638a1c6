#!/usr/bin/env bash
# Reproduces a Hugging Face Space's order of install and checks that it serves /generate on the
# compiled pruner and kernels (`make space-check`; minutes, so not part of `make test`):
#   1. a fresh venv from requirements.txt alone, plus the gradio of README's sdk_version (torch is
#      pre-installed as torch==2.13.0, the CPU wheel the Space's extra index gives: that index is not
#      reachable from this workplace);
#   2. the committed source tree, without build outputs (git archive);
#   3. python space.py (which compiles the two C++ extensions in place);
#   4. /generate answers through gradio_client, and the page's header names the C++ pruner and the
#      kernel build in use.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PORT=${PORT:-7893}
W=$(mktemp -d)
APP=
cleanup() { [ -n "$APP" ] && kill "$APP" 2>/dev/null; rm -rf "$W"; }
trap cleanup EXIT
SDK=$(sed -n 's/^sdk_version: *//p' "$ROOT/README.md")
python3 -m venv "$W/venv"
PY="$W/venv/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==2.13.0"
# requirements.txt as the Space reads it, minus its pytorch extra index where that index is unreachable
# (as here: pip would retry it for every package; torch is installed above)
if curl -sf -o /dev/null --max-time 5 https://download.pytorch.org/whl/cpu/; then REQ="$ROOT/requirements.txt"
else REQ="$W/requirements.txt"; grep -v '^--extra-index-url' "$ROOT/requirements.txt" > "$REQ"; fi
"$PY" -m pip install -q -r "$REQ" "gradio==$SDK"
mkdir "$W/app"
git -C "$ROOT" archive HEAD | tar -x -C "$W/app"
if ls "$W/app"/ngram_cpp/*.so "$W/app"/dart_core/*.so >/dev/null 2>&1; then echo "build outputs in the archive" >&2; exit 1; fi
(cd "$W/app" && exec "$PY" space.py --server-port "$PORT" > "$W/space.log" 2>&1) &
APP=$!
for _ in $(seq 1 200); do
  curl -sf -o /dev/null "http://127.0.0.1:$PORT/" && break
  kill -0 "$APP" 2>/dev/null || { cat "$W/space.log" >&2; echo "space.py exited" >&2; exit 1; }
  sleep 3
done
"$ROOT/.venv/bin/python" - "$PORT" <<'PYEOF'
import json, sys, urllib.request
from gradio_client import Client
port = sys.argv[1]
config = urllib.request.urlopen(f"http://127.0.0.1:{port}/config").read().decode()
assert "tree pruner: C++" in config, "the header does not name the C++ pruner"
assert " kernels" in config and "no CPU kernels" not in config, "the header does not name a kernel build"
path = config.split(" kernels")[0].rsplit("· ", 1)[-1]
r = Client(f"http://127.0.0.1:{port}/", verbose=False).predict("Name a colour.", "dart", 16, 0.0, 1.0, 0, api_name="/generate")
assert r["new_tokens"] > 0 and r["text"], r
print(f"space check: /generate answered {r['new_tokens']} tokens with DART (tau {r['tau']:.2f}); header: C++ pruner, {path} kernels")
PYEOF
