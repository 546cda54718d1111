"""One vLLM instance with the pagedkv connector, run as its own process by the fleet tests.

    python fleet_instance.py SPEC.json  ->  one JSON line on stdout (the last line)

SPEC: {"pagedkv": {...}, "store": {extra config} or null (no connector), "role": "kv_both",
"steps": [...]}; each step is {"prompts": [token id lists], "max_tokens": N} (greedy), or
{"reset": true} (empty vLLM's own prefix cache, so the next prompt can only hit the store), or
{"damage": DIR} / {"wipe": DIR} (flip a byte in / remove every stored entry under DIR), or
{"kill": PID} (SIGKILL a process, e.g. the redis-server), or {"prompts": [...], "logprobs": K}
(each prompt position's top-K log-probabilities and the actual token's). Per generate step the result lists
each prompt's tokens, vLLM's num_cached_tokens and the step's wall time; "stats" holds the connector's counters
(scheduler and worker side) after each step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine import engine, prompt_logprobs  # noqa: E402

CONNECTOR = {"kv_connector": "PagedKVConnector", "kv_connector_module_path": "pagedkv.integrations.vllm.connector"}


def entries(root: str) -> list[str]:
    """Every stored record file under a disk store directory (not its secret)."""
    out = []
    for d, _, files in os.walk(root):
        out += [os.path.join(d, f) for f in files if f.startswith("pkv")]
    return sorted(out)


def transfer_config(store, role: str) -> dict:
    return dict(CONNECTOR, kv_role=role, kv_connector_extra_config=store)


def connector_stats(llm) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
    out = {"scheduler": dict(sched.stats) if sched is not None else None}
    out["worker"] = dict(get_kv_transfer_group().stats) if has_kv_transfer_group() else None
    return out


def run(spec: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(spec.get("engine", {}))
    if spec.get("store") is not None:
        kw["kv_transfer_config"] = transfer_config(spec["store"], spec.get("role", "kv_both"))
    results = []
    with engine(spec.get("pagedkv"), **kw) as llm:
        for step in spec["steps"]:
            if step.get("reset"):
                assert llm.reset_prefix_cache()
            elif "damage" in step:
                for path in entries(step["damage"]):
                    with open(path, "r+b") as f:
                        f.seek(os.path.getsize(path) // 2)
                        b = f.read(1)
                        f.seek(-1, 1)
                        f.write(bytes([b[0] ^ 0x5A]))
            elif "wipe" in step:
                for path in entries(step["wipe"]):
                    os.unlink(path)
            elif "kill" in step:
                os.kill(int(step["kill"]), signal.SIGKILL)
            elif "logprobs" in step:
                lps = prompt_logprobs(llm, step["prompts"], k=step["logprobs"])
                results.append({"logprobs": [[{str(t): v for t, v in pos.items()} for pos in w] for w in lps]})
            else:
                sp = SamplingParams(max_tokens=step["max_tokens"], temperature=0.0, ignore_eos=True)
                t0 = time.perf_counter()
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in step["prompts"]], sp,
                                    use_tqdm=False)
                results.append({"seconds": time.perf_counter() - t0,
                                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                                "cached": [o.num_cached_tokens for o in outs],
                                "stats": connector_stats(llm) if spec.get("store") is not None else None})
    return {"results": results}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    print(json.dumps(run(spec)))
