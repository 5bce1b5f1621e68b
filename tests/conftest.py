"""Test settings: CPU only, offline, outputs under tmp_path, float64 where exactness is claimed."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# One thread per test worker under pytest-xdist (make test runs one worker per core), else up to two.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the kept helps (lmc.cli.help_cache)
