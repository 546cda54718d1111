"""Cases pagedkv's vLLM backend does not serve fail at engine start with a clear message, and an
engine that names no pagedkv format is vLLM's own (installing pagedkv changes nothing)."""

import json

import pytest

from engine import engine


def _tiny(tmp_path, name, cfg):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _start(model_or_none, pagedkv, **kw):
    args = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=256)
    args.update(kw)
    if model_or_none is not None:
        args["model"] = model_or_none
    with engine(pagedkv, **args):
        pass


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 160,
         "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 512,
         "rms_norm_eps": 1e-5, "torch_dtype": "float32"}
BLOOM = {"architectures": ["BloomForCausalLM"], "model_type": "bloom", "hidden_size": 64, "n_head": 4,
         "n_layer": 2, "vocab_size": 512, "layer_norm_epsilon": 1e-5, "torch_dtype": "float32"}


def test_unknown_format_name_is_refused_naming_it(tmp_path):
    cfg = dict(LLAMA, hidden_size=128, head_dim=32)
    with pytest.raises(Exception, match="turbo9"):
        _start(_tiny(tmp_path, "llama", cfg), {"kv_format": "turbo9"})


def test_head_dim_the_codec_cannot_store_is_refused(tmp_path):
    with pytest.raises(Exception, match="head_dim to be a multiple of 16, got 40"):
        _start(_tiny(tmp_path, "llama40", LLAMA), {"kv_format": "turbo3"})


def test_alibi_is_refused(tmp_path):
    with pytest.raises(Exception, match="ALiBi"):
        _start(_tiny(tmp_path, "bloom", BLOOM), {"kv_format": "turbo3"})


def test_no_pagedkv_setting_leaves_vllm_alone(tmp_path):
    """Same tiny model without the setting: vLLM's own CPU backend serves it."""
    cfg = dict(LLAMA, hidden_size=128, head_dim=32)
    with engine(None, model=_tiny(tmp_path, "plain", cfg), load_format="dummy", skip_tokenizer_init=True,
                max_model_len=256) as llm:
        ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
        names = {type(m.impl).__name__ for m in ctx.values() if hasattr(m, "impl")}
        assert names == {"CPUAttentionBackendImpl"}
