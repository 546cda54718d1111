"""The cache keyword follows what the model's forward declares (transformers renamed
`past_key_values=` to `cache=`; the old versions swallow the new name in **kwargs)."""

import pytest

from pagedkv.errors import ConfigError
from pagedkv.integrations.hf_compat import cache_keyword, with_cache


class _New:
    def forward(self, input_ids=None, cache=None, **kwargs): ...


class _Old:
    def forward(self, input_ids=None, past_key_values=None, **kwargs): ...


class _Neither:
    def forward(self, input_ids=None, **kwargs): ...


def test_the_declared_keyword_is_used():
    assert cache_keyword(_New()) == "cache"
    assert with_cache(_Old(), 7) == {"past_key_values": 7}


def test_a_model_without_a_cache_argument_is_refused():
    with pytest.raises(ConfigError, match="neither cache= nor past_key_values="):
        cache_keyword(_Neither())


def test_layer_layout_takes_both_forms_of_the_layer_kwargs(monkeypatch):
    """transformers 5.25 gives one kwargs dict per layer, 5.17 (seen on a GPU machine's image) one
    dict for every layer; both give a sliding window per sliding layer."""
    transformers = pytest.importorskip("transformers")
    from transformers import cache_utils

    from pagedkv.integrations.hf_common import _layer_layout

    cfg = transformers.Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                        sliding_window=8, layer_types=["sliding_attention", "sliding_attention",
                                                                       "full_attention"])
    new = _layer_layout(cfg)
    types = list(cfg.layer_types)
    monkeypatch.setattr(cache_utils, "get_layer_types_and_kwargs", lambda c: (types, {"sliding_window": 8}))
    assert _layer_layout(cfg) == new == (types, [8, 8, None], [1, 1, 1], [32, 32, 32])
