"""Shared fixtures: tiny random Llama / Qwen2 / Qwen3 targets built in the test, and the embedded model.
The helpers the test modules share are in support.py; this file holds fixtures only."""

from __future__ import annotations

from pathlib import Path

import pytest

from dart_core.target import Target

from support import build_tiny_checkpoint, tiny_target


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_ckpt(request, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    return arch, build_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Target:
    return tiny_target(build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama"))


@pytest.fixture(scope="session")
def embedded_target() -> Target:
    from dart_core import load_target

    return load_target("default", "cpu", "float32")


@pytest.fixture(scope="session")
def embedded_bf16() -> Target:
    from dart_core import load_target

    return load_target("default", "cpu", "bfloat16")
