"""The converted-model cache (`pagedkv.eval.model_cache`): a GGUF loaded once is kept as a private
local folder; a load from that folder gives the same weights, tokens and logits, and a folder that
is not private or not complete is never used."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from pagedkv.eval import model_cache as mc  # noqa: E402
from pagedkv.eval.model import embedded_model_source, load_model, load_tokenizer  # noqa: E402

pytestmark = pytest.mark.model


def test_a_converted_model_equals_the_gguf_load_and_only_a_private_folder_is_used(tmp_path):
    src = embedded_model_source()
    gguf = os.path.join(src.directory, src.gguf_file)
    root = tmp_path / "models"
    a = load_model(src, model_cache=root)  # from the GGUF; writes the folder
    folder = mc.lookup(root, gguf)
    assert folder is not None and folder.name == mc.folder_key(gguf)
    b = load_model(src, model_cache=root, tokenizer=load_tokenizer(src, model_cache=root))
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    text = "def f(x):\n    return x  # ünïcode, tabs\tand 1234567"
    ids = a.tokenizer(text, return_tensors="pt").input_ids
    assert torch.equal(ids, b.tokenizer(text, return_tensors="pt").input_ids)
    chat = [{"role": "user", "content": "hi"}]
    assert a.tokenizer.apply_chat_template(chat) == b.tokenizer.apply_chat_template(chat)
    with torch.no_grad():
        assert torch.equal(a.model(ids).logits, b.model(ids).logits)
    # a file others may write, a missing file or a folder that is a symlink: not used
    weights = folder / "model.safetensors"
    os.chmod(weights, 0o664)
    assert mc.lookup(root, gguf) is None
    os.chmod(weights, 0o644)
    assert mc.lookup(root, gguf) == folder
    (folder / "tokenizer.json").rename(folder / "moved.json")
    assert mc.lookup(root, gguf) is None


def test_a_cache_that_cannot_be_written_is_skipped(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    src = embedded_model_source()
    gguf = os.path.join(src.directory, src.gguf_file)
    assert mc.save(not_a_dir, gguf, model=None, tokenizer=None) is None
    assert mc.lookup(not_a_dir, gguf) is None
    open_root = tmp_path / "shared"
    open_root.mkdir(mode=0o777)
    os.chmod(open_root, 0o777)
    assert mc.save(open_root, gguf, model=None, tokenizer=None) is None  # not private: nothing written
    assert list(open_root.iterdir()) == []


def test_a_model_that_cannot_be_written_leaves_nothing_behind(tmp_path):
    src = embedded_model_source()
    gguf = os.path.join(src.directory, src.gguf_file)
    root = tmp_path / "models"
    assert mc.save(root, gguf, model=object(), tokenizer=None) is None  # no .config: the writer fails
    assert list(root.iterdir()) == [] and mc.lookup(root, gguf) is None


def test_the_folder_is_keyed_by_the_files_bytes_not_its_path(tmp_path):
    """Two checkouts of the same GGUF share one converted folder; a file with other bytes gets its own."""
    data = os.urandom(5 << 20)
    a, b, c = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, body in ((a, data), (b, data), (c, data[:-1] + bytes([data[-1] ^ 1]))):
        path.parent.mkdir()
        path.write_bytes(body)
    os.utime(b, ns=(1, 1))
    assert mc.folder_key(str(a)) == mc.folder_key(str(b))
    assert mc.folder_key(str(c)) != mc.folder_key(str(a))
    assert mc.folder_key(str(a)).startswith("m-")
