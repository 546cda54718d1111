"""Prefix caching across `generate` calls in the transformers drop-in, on the embedded SmolLM2.

A long shared system prompt, then a short question: the time of `generate(max_new_tokens=1)`
(the prefill) on the same cache with the prefix hits (`cache.begin(ids)`) and without them
(`cache.begin(ids, reuse=False)`), medians of 5 back-to-back pairs, 1 thread, in one process.

    PYTHONPATH=src HF_HUB_OFFLINE=1 python benchmarks/perf/prefix_generate.py
"""

from __future__ import annotations

import statistics
import time

import torch

from pagedkv.eval.model import embedded_model_source, load_model
from pagedkv.integrations.transformers import PagedKVCache, enable

SYSTEM = ("You are a careful assistant for a team of engineers. " * 24).strip()


def main() -> None:
    torch.set_num_threads(1)
    lm = load_model(embedded_model_source(), attn_implementation="sdpa")
    tok, model = lm.tokenizer, lm.model
    enable(model)

    def chat(q):
        return tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": q}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)["input_ids"]

    first, second = chat("What is a Python decorator?"), chat("Why is the sky blue?")
    kw = dict(max_new_tokens=1, do_sample=False, pad_token_id=tok.eos_token_id)
    cache = PagedKVCache(model, "turbo3")
    with torch.inference_mode():
        model.generate(first, cache=cache, **kw)
        times = {True: [], False: []}
        hits = 0
        for _ in range(5):
            for reuse in (True, False):
                h = cache.begin(second, reuse=reuse)
                hits = max(hits, h)
                t0 = time.perf_counter()
                model.generate(second, cache=cache, **kw)
                times[reuse].append(time.perf_counter() - t0)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"prompt {second.shape[1]} tokens, prefix hits {hits} tokens (turbo3, 1 thread)")
    print(f"prefill with hits {on * 1e3:.0f} ms, without {off * 1e3:.0f} ms: "
          f"{off / on:.2f}x faster, {(off - on) * 1e3:.0f} ms saved")


if __name__ == "__main__":
    main()
