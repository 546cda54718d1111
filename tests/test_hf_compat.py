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
