"""One vLLM instance with the pagedkv connector, run as its own process by the fleet tests.

    python fleet_instance.py SPEC.json  ->  one JSON line on stdout (the last line)

SPEC: {"pagedkv": {...}, "store": {extra config} or null (no connector), "role": "kv_both",
"steps": [...]}; each step is {"prompts": [token id lists], "max_tokens": N} (greedy), or
{"reset": true} (empty vLLM's own prefix cache, so the next prompt can only hit the store), or
{"damage": DIR} / {"wipe": DIR} (flip a byte in / remove every stored entry under DIR), or
{"kill": PID} (SIGKILL a process, e.g. the redis-server), or {"prompts": [...], "logprobs": K}
(each prompt position's top-K log-probabilities and the actual token's; with "pages": [layer indices] or "all",
of one prompt, also the bytes its request wrote in those layers' pages, per tensor-parallel rank:
`logprobs_and_pages`). Per generate step the result lists
each prompt's tokens, vLLM's num_cached_tokens and the step's wall time; "stats" holds the connector's counters
(scheduler and worker side) after each step.
"""

from __future__ import annotations

import base64
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


def rank_pages(worker, layers, blocks: list) -> tuple:
    """(this rank, {layer index (of `layers`: a list, or "all"): its format, KV heads, block
    size and the K and V page bytes of `blocks`, base64}): run in every worker by
    `collective_rpc`, through the connector's view of the pages (`impl.page_layers`)."""
    import torch
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    from pagedkv.integrations.vllm.impl import _pagedkv_layers, page_layers

    cfg = worker.vllm_config
    found = _pagedkv_layers(cfg)
    paged = page_layers(cfg, {name: mod.kv_cache for name, mod in found})
    idx = torch.tensor(blocks, dtype=torch.long)
    out = {}
    for i in range(len(paged)) if layers == "all" else layers:
        pl = paged[i]
        out[i] = {"format": found[i][1].impl.fmt.name, "heads": pl.num_kv_heads, "block_size": pl.block_size,
                  **{side: base64.b64encode(pool.index_select(0, idx).contiguous().numpy().tobytes()).decode()
                     for side, pool in (("k", pl.k_pool), ("v", pl.v_pool))}}
    return get_tensor_model_parallel_rank(), out


def logprobs_and_pages(llm, prompt: list, k: int, layers) -> dict:
    """One prompt's prompt log-probabilities (as `engine.prompt_logprobs`) and, per rank, the
    pages its request wrote in `layers` (`rank_pages`, in the request's block order)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    sp = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=k, ignore_eos=True)
    llm.llm_engine.add_request("pages", TokensPrompt(prompt_token_ids=list(map(int, prompt))), sp)
    blocks, final = [], None
    while llm.llm_engine.has_unfinished_requests():
        for o in llm.llm_engine.step():
            final = o if o.finished else final
        held = list(manager.req_to_blocks.values())  # the one request's blocks while it runs
        blocks = [b.block_id for b in held[0]] if held else blocks
    lps = [{t: lp.logprob for t, lp in pos.items()} for pos in final.prompt_logprobs[1:]]
    ranks = dict(llm.collective_rpc(rank_pages, args=(layers, blocks)))
    return {"logprobs": [[{str(t): v for t, v in pos.items()} for pos in lps]],
            "blocks": blocks, "pages": {str(r): p for r, p in sorted(ranks.items())}}


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
            elif "logprobs" in step and "pages" in step:
                (prompt,) = step["prompts"]
                results.append(logprobs_and_pages(llm, prompt, step["logprobs"], step["pages"]))
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
