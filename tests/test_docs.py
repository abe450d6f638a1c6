"""The documents say what the repository holds now: every repository path README.md and docs/*.md
name exists, the README and docs/gpu.md stay short, and no document or code comment describes how the
team happens to borrow hardware (they say how any user runs things).

Which names are repository paths, by one rule (nothing else is skipped):
- a markdown link's target, relative to the document that holds it (web addresses and #anchors are not
  files);
- a word anywhere in the text (prose, `backticks`, fenced code) whose first component is one of
  ROOTS, the repository's own top-level names (`dart_core/...`, `scripts/...`, `tests/...`,
  `docs/...`), or which is one of ROOT_FILES. A word that starts elsewhere (`~/.cache/...`,
  `../shared/...`, `/tmp/...`, a web address, a bare module name) names nothing in the repository, so
  it is not checked.
A shell pattern is checked by what it matches: `dir/{a,b}.json` names both files, `src/*.cpp` at least
one. docs/changelog.md is history: it names files as they were then, so its words are not checked
(its links are).
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HISTORY = {ROOT / "docs" / "changelog.md"}
ROOTS = ("dart_core", "dart_vllm", "ngram_cpp", "app", "assets", "docs", "scripts", "tests", ".ci")
ROOT_FILES = ("Makefile", "pyproject.toml", "setup.py", "space.py", "requirements.txt")

# How a particular way of borrowing a GPU was described; the product's text says how any user runs it.
BANNED = [
    r"\blent\b",
    r"\blend(s|ing)?\b",
    r"\bborrow",
    r"device time",
    r"idle seconds",
    r"the device tool",
    r"H200's Python",
    r"device calls?\b",
    r"device sessions?\b",
    r"lent session",
    r"KINDS\.md",
    r"can_start_another",
    r"budget_left",
    r"files_at",
]

# the code's comments and docstrings by the same list ("device time" alone is also a GPU's kernel time there)
CODE_BANNED = [p for p in BANNED if p != r"device time"] + [r"minutes of device time"]
CODE = [
    f
    for d in ("dart_core", "app", "scripts", "tests", "dart_vllm", "ngram_cpp", ".ci")
    for f in sorted((ROOT / d).rglob("*"))
    if f.is_file() and (f.suffix in (".py", ".sh", ".cpp", ".h", ".hpp") or f.name == "run") and f != Path(__file__).resolve()
] + [ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / "setup.py", ROOT / "space.py"]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# a word that starts at a repository root: not inside another path (/, ., ~ or a word character before it)
WORD = re.compile(r"(?<![\w/.~$-])((?:" + "|".join(re.escape(r) for r in ROOTS) + r")/[\w./{},*?-]*"
                  r"|(?:" + "|".join(re.escape(f) for f in ROOT_FILES) + r")\b)")  # fmt: skip


def expand(path: str) -> list[str]:
    """A shell brace pattern's alternatives: a/{b,c}.d -> a/b.d, a/c.d."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",") for x in expand(path[: m.start()] + alt + path[m.end() :])]


def repo_word(word: str) -> str | None:
    """The repository path a word of code names, by the module's rule, else None."""
    word = word.strip("\"'(),;:.[]").split("::")[0]  # quotes and punctuation around it; a pytest node id's test
    word = re.sub(r":\d+$", "", word)  # file:line
    first = word.split("/")[0]
    if first in ROOT_FILES and word == first:
        return word
    if first in ROOTS and "/" in word:
        return word
    return None


def named_paths(doc: Path) -> list[tuple[str, Path]]:
    """(as written, path) for every repository path the document names."""
    text = doc.read_text()
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address or an anchor in the same document
        out.append((target, (doc.parent / target.split("#")[0]).resolve()))
    if doc in HISTORY:
        return out
    for word in WORD.findall(text):
        path = repo_word(word)
        if path is not None:
            out.append((path, ROOT / path))
    return out


def missing(written: str, path: Path) -> bool:
    for one in expand(str(path)):
        if any(c in one for c in "*?["):
            if not glob.glob(one):
                return True
        elif not Path(one).exists():
            return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_repository_path_a_document_names_exists(doc):
    stale = sorted({w for w, p in named_paths(doc) if missing(w, p)})
    assert not stale, f"{doc.relative_to(ROOT)} names paths that do not exist: {stale}"


def test_the_rule_finds_paths_and_leaves_out_what_is_not_the_repository(tmp_path):
    assert repo_word("`dart_core/cli/report.py`".strip("`")) == "dart_core/cli/report.py"
    assert repo_word("tests/test_docs.py::test_x") == "tests/test_docs.py"
    assert repo_word("Makefile") == "Makefile" and repo_word("dart_core") is None  # a bare package name is a module
    for elsewhere in ("~/.cache/dart-demo/llamacpp", "../shared/data/bench", "/tmp/dart", "fixed_shape.py", "$OUT/x"):
        assert repo_word(elsewhere) is None
    assert expand("docs/results/{a,b}.json") == ["docs/results/a.json", "docs/results/b.json"]
    doc = tmp_path / "docs" / "x.md"
    doc.parent.mkdir()
    doc.write_text(
        "See [the engine](engine.md) and [a site](https://example.com), `scripts/nope.py --out DIR`,\n"
        "```bash\npython tests/gone.py ~/.cache/x\n```\n"
    )
    doc.write_text(doc.read_text() + "Prose names dart_core/gone.py, https://x.org/tests/a.py and ~/.cache/dart_core/b.\n")
    names = [w for w, _ in named_paths(doc)]
    assert names == ["engine.md", "scripts/nope.py", "tests/gone.py", "dart_core/gone.py"]
    # every document names some repository paths: the rule did not find nothing
    assert sum(len(named_paths(d)) for d in DOCS) > 100


def test_the_readme_and_the_gpu_doc_stay_short():
    readme = (ROOT / "README.md").read_text().splitlines()
    gpu = (ROOT / "docs" / "gpu.md").read_text().splitlines()
    assert len(readme) < 120, f"README.md has {len(readme)} lines"
    assert len(gpu) < 250, f"docs/gpu.md has {len(gpu)} lines"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_no_document_describes_how_hardware_is_borrowed(doc):
    text = doc.read_text()
    found = [m.group(0) for pattern in BANNED for m in re.finditer(pattern, text, re.I)]
    assert not found, f"{doc.relative_to(ROOT)} describes a borrowing arrangement: {found}"


def test_no_code_comment_describes_how_hardware_is_borrowed():
    found = []
    for f in CODE:
        text = f.read_text(errors="replace")
        for pattern in CODE_BANNED:
            for m in re.finditer(pattern, text, re.I):
                found.append(f"{f.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}")
    assert len(CODE) > 100 and not found, found
