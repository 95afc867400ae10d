"""A node's .gguf models are imported before its TEs start (supervisor/
model_import.py): every path naming one becomes its imported directory under
[node] gguf_cache_dir, once per file, served under the file's name."""

from __future__ import annotations

import json

import pytest

from deepserve.errors import ModelLoadError
from deepserve.supervisor.model_import import import_node_models
from deepserve.supervisor.node_config import load_node_config
from tests.model.gguf_factory import write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(model_dirs, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "Tiny-Chat.Q8_0.gguf"
    write_gguf(model_dirs["qwen2"], path)
    return path


def _conf(tmp_path, model: str, extra: str = "") -> str:
    (tmp_path / "conf").mkdir(exist_ok=True)
    toml = tmp_path / "conf" / "node.toml"
    toml.write_text(f'[node]\nmodel = "{model}"\ngguf_cache_dir = "cache"\n[[te]]\n{extra}')
    return str(toml)


def test_gguf_paths_become_their_imported_directory(tiny_gguf, tmp_path):
    extra = f'[[model]]\npath = "{tiny_gguf}"\nname = "again"\nmin_tes = 0\n'
    config = load_node_config(_conf(tmp_path, str(tiny_gguf), extra))
    assert config.node.served_model == "Tiny-Chat.Q8_0"  # the file's name less .gguf
    imported = import_node_models(config)
    directory = imported.node.model
    assert directory.startswith(str(tmp_path / "cache")) and imported.models[0].path == directory
    assert json.loads((tmp_path / "cache").joinpath(directory, "config.json").read_text())[
        "model_type"] == "qwen2"
    assert len(list((tmp_path / "cache").iterdir())) == 1  # one file, one import
    assert imported.node.served_model == "Tiny-Chat.Q8_0" and imported.models[0].name == "again"


def test_a_config_without_gguf_is_returned_as_is(model_dirs, tmp_path):
    config = load_node_config(_conf(tmp_path, str(model_dirs["qwen2"])))
    assert import_node_models(config) is config
    assert not (tmp_path / "cache").exists()


def test_a_file_that_is_no_gguf_stops_the_node_naming_it(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    config = load_node_config(_conf(tmp_path, str(bad)))
    with pytest.raises(ModelLoadError, match="broken.gguf.*not a readable GGUF file"):
        import_node_models(config)
