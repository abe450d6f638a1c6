"""The codebase's shape, held: the engine (dart_core's own modules) imports no tool (dart_core/tools)
and no command line (dart_core/cli); the static import graph of dart_core, app and ngram_cpp has no
cycle; every command is one console script, and no library module is also a `python -m` entry point."""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dart_core", "app", "ngram_cpp")
UPPER = ("dart_core.tools", "dart_core.cli", "dart_core.cuda.check")  # the layers above the engine (the GPU check: a command)


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its body (function-level imports too: they
    run when called, and a cycle through them is still a cycle of knowledge)."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                # `from pkg import module` imports the module (its package is already being set up);
                # `from pkg import name` the package
                subs = [f"{target}.{a.name}" for a in node.names]
                names = [s for s in subs if s in mods] + ([target] if any(s not in mods for s in subs) else [])
            else:
                continue
            for name in names:
                parts = name.split(".")
                while parts and ".".join(parts) not in mods:
                    parts.pop()
                if parts and ".".join(parts) != mod:
                    graph[mod].add(".".join(parts))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_engine_imports_no_tool_and_no_command_line():
    graph = import_graph()
    engine = [m for m in graph if m.startswith("dart_core") and not m.startswith(UPPER)]
    assert "dart_core.generate" in engine and "dart_core.target" in engine
    bad = {m: sorted(t for t in graph[m] if t.startswith(UPPER)) for m in engine}
    assert {m: t for m, t in bad.items() if t} == {}


def test_the_tools_import_no_command_line():
    graph = import_graph()
    bad = {m: sorted(t for t in graph[m] if t.startswith("dart_core.cli")) for m in graph if m.startswith("dart_core.tools")}
    assert {m: t for m, t in bad.items() if t} == {}


def test_every_command_is_one_console_script():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"dart-app", "dart-bench", "dart-calibrate", "dart-train"} <= set(scripts)
    for name, target in scripts.items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), name
    # no second name: no module of the packages runs as `python -m ...`, and scripts/ holds no Python stubs
    mains = [str(p.relative_to(ROOT)) for p in modules().values() if 'if __name__ == "__main__"' in p.read_text()]
    assert mains == [] and not (ROOT / "app" / "__main__.py").exists()
    assert sorted(p.name for p in (ROOT / "scripts").glob("*.py")) == ["gpu_check.py"]  # the device check, run where the repo is
