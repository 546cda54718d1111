"""pagedkv pages shared across vLLM instances (`integrations/vllm/connector.py`).

Every instance is a separate engine in its own process (`fleet_instance.py`), serving the
embedded model with turbo3+hp pages and the same ~590-token prompt (4 whole 128-token blocks
that can be shared; the last partial block and token are always computed). Five instances, in
two rounds that run side by side to save time:
1. A (disk store, kv_both) serves the prompt first: the local run every other output must equal.
   P (kv_producer on a redis-server this test starts on a free loopback port) prefills it.
2. B (A's store) hits the 4 blocks and produces A's greedy tokens; then, its own prefix cache
   emptied each time, a damaged store (a byte flipped in every entry) and a wiped one are misses
   with A's tokens again. C (a copy of A's store, the same format, statistics fitted on other
   text) finds nothing: entries of other statistics are never its keys. D (kv_consumer on P's
   Redis) loads P's pages and decodes A's tokens (disaggregated prefill); then the redis-server
   is killed and D, its prefix cache emptied, recomputes the same tokens after one warning.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import model_dir
from workloads import prefix_prompt

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

FORMAT = {"kv_format": "turbo3+hp"}
MAX_TOKENS = 8
SHARED_BLOCKS = 4  # (593 - 1) // 128
SECRET = "fleet-test-secret-0123456789"


def _instance(tmp_path, name: str, spec: dict) -> tuple[dict, str]:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    out = subprocess.run([sys.executable, os.path.join(HERE, "fleet_instance.py"), str(path)],
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, f"instance {name}:\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])["results"], out.stderr


def _parallel(*calls):
    with ThreadPoolExecutor(len(calls)) as ex:
        futures = [ex.submit(*c) for c in calls]
        return [f.result() for f in futures]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    pytest.importorskip("redis", reason="the redis client package is not installed in the vLLM environment")
    from helpers.redis_server import RedisServer
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("fleet")
    server = RedisServer(tmp)
    if server.exe is None:
        pytest.skip("redis-server binary not found (Debian: apt-get install redis-server)")
    ids = AutoTokenizer.from_pretrained(model_dir())(prefix_prompt())["input_ids"]
    gen = {"prompts": [ids], "max_tokens": MAX_TOKENS}
    reset = {"reset": True}
    disk, other = str(tmp / "store"), str(tmp / "store-copy")
    (tmp / "secret").write_text(SECRET)
    redis = {"store": "redis", "store_secret_file": str(tmp / "secret")}
    server.start()
    try:
        redis["redis_url"] = server.url
        a, p = _parallel(
            (_instance, tmp, "A", {"pagedkv": FORMAT, "store": {"path": disk}, "steps": [gen]}),
            (_instance, tmp, "P", {"pagedkv": FORMAT, "store": redis, "role": "kv_producer",
                                   "steps": [dict(gen, max_tokens=1)]}))
        redis_keys = len(server.client.keys("pagedkv:*"))
        shutil.copytree(disk, other)
        b, c, d = _parallel(
            (_instance, tmp, "B", {"pagedkv": FORMAT, "store": {"path": disk},
                                   "steps": [gen, reset, {"damage": disk}, gen, reset, {"wipe": disk}, gen]}),
            (_instance, tmp, "C", {"pagedkv": dict(FORMAT, calibration_tokens=256), "store": {"path": other},
                                   "steps": [gen]}),
            (_instance, tmp, "D", {"pagedkv": FORMAT, "store": redis, "role": "kv_consumer",
                                   "steps": [gen, {"kill": server.proc.pid}, reset, gen]}))
    finally:
        server.kill()
    return {"A": a, "P": p, "B": b, "C": c, "D": d, "redis_keys": redis_keys}


def _run(fleet, name, i=0):
    (results, _stderr) = fleet[name]
    return results[i]


def test_the_first_instance_computes_and_publishes_every_shared_block(fleet):
    a = _run(fleet, "A")
    assert a["cached"] == [0]
    assert a["stats"]["scheduler"]["hit_blocks"] == 0
    assert a["stats"]["worker"]["published"] == SHARED_BLOCKS


def test_another_instance_hits_and_generates_the_local_tokens(fleet):
    a, b = _run(fleet, "A"), _run(fleet, "B")
    assert b["stats"]["scheduler"]["hit_blocks"] == SHARED_BLOCKS
    assert b["stats"]["worker"]["load_blocks"] == SHARED_BLOCKS and b["stats"]["worker"]["load_failed"] == 0
    assert b["cached"] == [SHARED_BLOCKS * 128]
    assert b["stats"]["worker"]["published"] == 0  # nothing new to share
    assert b["tokens"] == a["tokens"]


def test_damaged_and_missing_entries_are_misses_with_unchanged_output(fleet):
    a = _run(fleet, "A")
    damaged, wiped = _run(fleet, "B", 1), _run(fleet, "B", 2)
    for r in (damaged, wiped):
        assert r["cached"] == [0]  # vLLM's own cache was emptied, the store gave nothing
        assert r["tokens"] == a["tokens"]
        assert r["stats"]["scheduler"]["hit_blocks"] == SHARED_BLOCKS  # no hit beyond the first run's
        assert r["stats"]["worker"]["load_failed"] == 0
    stderr = fleet["B"][1]
    assert stderr.count("failed its checks") == 1, stderr[-3000:]  # the damaged first block, deleted
    # after each miss the computed blocks are published again (counters are cumulative)
    assert damaged["stats"]["worker"]["published"] == SHARED_BLOCKS
    assert wiped["stats"]["worker"]["published"] == 2 * SHARED_BLOCKS


def test_entries_of_other_statistics_are_never_loaded(fleet):
    c = _run(fleet, "C")
    assert c["stats"]["scheduler"]["lookups"] == 1 and c["stats"]["scheduler"]["hit_blocks"] == 0
    assert c["cached"] == [0]
    assert c["stats"]["worker"]["published"] == SHARED_BLOCKS  # its own pages, beside A's


def test_disaggregated_prefill_through_redis_gives_one_instances_tokens(fleet):
    a, p, d = _run(fleet, "A"), _run(fleet, "P"), _run(fleet, "D")
    assert p["stats"]["scheduler"]["lookups"] == 0  # a producer never looks up
    assert p["stats"]["worker"]["published"] == SHARED_BLOCKS == fleet["redis_keys"]
    assert d["stats"]["worker"]["load_blocks"] == SHARED_BLOCKS and d["cached"] == [SHARED_BLOCKS * 128]
    assert d["stats"]["worker"]["published"] == 0  # a consumer never publishes
    assert d["tokens"] == a["tokens"]


def test_redis_killed_mid_run_gives_the_same_tokens_after_one_warning(fleet):
    a, after = _run(fleet, "A"), _run(fleet, "D", 1)
    assert after["cached"] == [0] and after["tokens"] == a["tokens"]
    assert after["stats"]["worker"]["load_blocks"] == SHARED_BLOCKS  # nothing more was loaded
    stderr = fleet["D"][1]
    assert stderr.count("unreachable or slow") == 1, stderr[-3000:]


def test_a_recent_window_with_the_connector_is_refused_saying_what_works(tmp_path):
    """The window's tail is a second KV-cache group the connector does not carry: refused at
    engine start (before any statistics are fitted), naming what does work."""
    from engine import engine
    from fleet_instance import transfer_config

    with pytest.raises(Exception, match="recent window .* without the window"):
        with engine({"kv_format": "turbo3+r64"}, load_format="dummy",
                    kv_transfer_config=transfer_config({"path": str(tmp_path / "store")}, "kv_both")):
            pass
