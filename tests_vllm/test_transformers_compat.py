"""pagedkv's transformers front doors on the transformers this environment pins (< 5.20, where
a model takes its cache as `past_key_values=` and swallows an unknown `cache=`): the eval must
really run on the compressed cache (a KL above 0), never silently on transformers' own cache."""

import json
import os
import subprocess
import sys

from engine import ROOT, model_dir


def test_eval_engages_the_paged_cache_on_this_transformers():
    import transformers

    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "pagedkv.cli.main", "eval", "--model", model_dir(),
                          "--windows", "1", "--window-tokens", "96", "--formats", "bf16,turbo3",
                          "--threads", "1", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["format"]: r for r in json.loads(out.stdout)}
    assert rows["bf16"]["kl"] == 0.0
    # turbo3 on this model and text: ~0.09 at 128 tokens; 0 would mean the cache was not used
    assert rows["turbo3"]["kl"] > 0.01, (transformers.__version__, rows["turbo3"])
