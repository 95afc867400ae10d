"""Factories of the model tests: the hf_zoo checkpoints, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.model.hf_zoo import SHAPES, make_hf_model


@pytest.fixture(scope="session")
def zoo_dirs(tmp_path_factory, tiny_model) -> dict[str, Path]:
    """hf_zoo shape -> its float32 checkpoint directory (transformers' own files)."""
    base = tmp_path_factory.mktemp("zoo")
    return {shape: make_hf_model(base / shape, shape, tiny_model) for shape in SHAPES}
