"""Start, query and stop an in-process vLLM engine for the tests (one at a time)."""

from __future__ import annotations

import gc
import math
import os
from contextlib import contextmanager
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.environ.get("PAGEDKV_VLLM_MODEL", os.path.join(ROOT, ".venv-vllm", "smollm2-hf"))
KV_BYTES = 64 << 20
MAX_LEN = 1024


def model_dir() -> str:
    if not os.path.isfile(os.path.join(MODEL, "config.json")):
        raise RuntimeError(f"the converted model is missing at {MODEL}: run `make vllm-setup` "
                           "(or set PAGEDKV_VLLM_MODEL)")
    return MODEL


@contextmanager
def engine(pagedkv: Optional[dict], **kwargs):
    """An LLM on the embedded model (fp32, eager, 64 MiB of KV); pagedkv=None is vLLM's own."""
    from vllm import LLM
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()  # one process serves several engines here
    args = dict(model=model_dir(), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=KV_BYTES,
                max_model_len=MAX_LEN, distributed_executor_backend="uni", seed=0)
    args.update(kwargs)
    if pagedkv is not None:
        args["additional_config"] = {"pagedkv": pagedkv}
    llm = LLM(**args)
    try:
        yield llm
    finally:
        shutdown(llm)


def shutdown(llm) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def capacity_tokens(llm) -> tuple[int, int]:
    """(blocks, tokens) of KV capacity vLLM reports for this engine."""
    cc = llm.llm_engine.vllm_config.cache_config
    return int(cc.num_gpu_blocks), int(cc.num_gpu_blocks) * int(cc.block_size)


def prompt_logprobs(llm, token_windows, k: int = 20):
    """Per window, per position 1.., a dict token -> logprob (top k and the actual token)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(map(int, w))) for w in token_windows], sp,
                        use_tqdm=False)
    return [[{t: lp.logprob for t, lp in pos.items()} for pos in o.prompt_logprobs[1:]] for o in outs]


def greedy(llm, prompts, max_tokens: int):
    """Greedy token ids and texts of each prompt."""
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text, o.num_cached_tokens) for o in outs]


def held_blocks(llm, prompt_ids, max_tokens: int):
    """Run one request step by step; after each step, (computed tokens, blocks it holds in each
    KV-cache group) from vLLM's own KV-cache manager (null entries, i.e. freed, not counted)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    managers = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.coordinator.single_type_managers
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.llm_engine.add_request("held", TokensPrompt(prompt_token_ids=list(map(int, prompt_ids))), sp)
    out = []
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
        for rid in list(managers[0].req_to_blocks):
            if rid in sched.requests:
                out.append((sched.requests[rid].num_computed_tokens,
                            [sum(not b.is_null for b in m.req_to_blocks[rid]) for m in managers]))
    return out


def coarse_kl(ref, other) -> float:
    """Mean over positions of KL(ref || other) on the partition {each token both engines
    reported} + {everything else}: a lower bound of the full KL (data processing) that is
    close to it when the reported tokens hold most of the mass."""
    total, n = 0.0, 0
    for rw, ow in zip(ref, other):
        for rp, op in zip(rw, ow):
            common = [t for t in rp if t in op]
            kl = 0.0
            pr = qr = 1.0
            for t in common:
                p, q = math.exp(rp[t]), math.exp(op[t])
                kl += p * (rp[t] - op[t])
                pr -= p
                qr -= q
            pr, qr = max(pr, 1e-12), max(qr, 1e-12)
            kl += pr * math.log(pr / qr)
            total += kl
            n += 1
    return total / max(n, 1)
