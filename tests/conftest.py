"""Session-scoped tiny checkpoints and bundles (exported once per test session)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# `pytest -n 2` (the README's command) runs two workers on CI's 2 cores. Each gave torch's OpenMP
# pool a thread per core, and the four spinning threads slowed the training tests down up to 7x
# (test_pair's resume test: 35 s against 5 s). One torch thread per worker; set before torch loads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """arch -> (target_dir, draft_dir) for gpt2, llama (GQA) and t5; built lazily on first use."""
    import tiny_models

    root = tmp_path_factory.mktemp("ckpt")
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = tiny_models.make_pair(root, arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, tiny_checkpoints):
    """arch -> path of an exported target+draft bundle (fp32), exported once per session."""
    from edgespec.export.pipeline import export_bundle

    root = tmp_path_factory.mktemp("bundles")
    cache: dict = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            target, draft = tiny_checkpoints(arch)
            out = root / arch
            export_bundle(target, out, draft=draft, progress=None)
            cache[arch] = out
        return cache[arch]

    return get


@pytest.fixture
def bundle_copy(tiny_bundle, tmp_path):
    """A private copy of a tiny bundle that a test may corrupt."""

    def get(arch: str = "gpt2") -> Path:
        dst = tmp_path / f"copy-{arch}"
        shutil.copytree(tiny_bundle(arch), dst)
        return dst

    return get
