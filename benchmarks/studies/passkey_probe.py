"""Teacher-forced retrieval probe: what a KV format costs the answer, per trial, in one prefill.

`pagedkv eval --task passkey` scores greedy generations (right or wrong). To compare many
candidate formats or plans quickly, this probe feeds each trial's prompt followed by its answer
(the pass key's 5 digits, or with `--task multikey` the needle's 7-digit value) through the compressed cache, in the same trials and order as the eval (seeded,
`sharing_order`, prefix caching, statistics fixed by the first trial), and prints per format the
trials whose every answer token is the model's argmax (the greedy answer, up to what follows the
digits), the mean log-probability of the answer, and which trials bf16 gets right and the format
does not. It ran the layer-group and window diagnostics of docs/long-context.md.

    PYTHONPATH=src python benchmarks/studies/passkey_probe.py --length 2048 --trials 30 \\
        --formats bf16,turbo3g32+r32s16q8_0,turbo3g32+r32q8_0 [--pick 0,4,8] [--out probe.json]
        [--task multikey --keys 1 --cue question]   # the eval's multikey trials instead
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--pick", default="", help="comma list of trial indices to run (default: all)")
    p.add_argument("--formats", required=True, help="comma list of specs (plan files included); bf16 first "
                   "to get the lost trials")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", default="passkey", help="passkey or multikey (the eval's tasks)")
    p.add_argument("--keys", type=int, default=4, help="multikey: needles per context (as the eval's --keys)")
    p.add_argument("--cue", default="question", help="multikey: question or opening (as the eval's --cue)")
    p.add_argument("--out", default=None, help="JSON: per format, per trial [log-prob, right]")
    a = p.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    from pagedkv.eval.model import load_model, load_tokenizer, resolve_model_source
    from pagedkv.eval.retrieval_tasks import TextCodec, generate, sharing_order
    from pagedkv.eval.runner import cache_for, layout_numbers, parse_choice
    from pagedkv.eval.text import bos_id, read_text, tokenize
    from pagedkv.integrations.hf_compat import with_cache
    from pagedkv.integrations.transformers import enable

    source = resolve_model_source(a.model)
    tok = load_tokenizer(source)
    codec = TextCodec(tok)
    trials = generate(a.task, a.length, a.trials, codec, bos=bos_id(tok), seed=a.seed, keys=a.keys, cue=a.cue,
                      text_tokens=lambda: tokenize(tok, read_text(None)).tolist())
    if a.pick:
        keep = {int(x) for x in a.pick.split(",")}
        trials = [t for t in trials if t.index in keep]
    trials = sharing_order(trials)
    lm = load_model(source, attn_implementation="pagedkv", tokenizer=tok)
    enable(lm.model)
    model = lm.model
    results: dict = {}
    for spec in a.formats.split(","):
        choice = parse_choice(spec)
        cache = cache_for(model, choice, 16, checks=False)
        bits = layout_numbers(cache, 1, choice.recent, a.length)[0]
        kw = with_cache(model, cache)
        cpu0 = time.process_time()
        per = {}
        with torch.inference_mode():
            for t in trials:
                answer = codec.encode(" " + t.answer)
                prompt = list(t.prompt)
                hit = cache.begin(torch.tensor([prompt]))
                ids = torch.tensor([prompt + answer])
                logits = model(ids[:, hit:], **kw, use_cache=True).logits[0].float()
                first = len(prompt) - hit - 1  # the row predicting the answer's first token
                lp = torch.log_softmax(logits[first:first + len(answer)], -1)
                target = torch.tensor(answer)
                per[t.index] = (round(float(lp[torch.arange(len(answer)), target].sum()), 4),
                                bool((lp.argmax(-1) == target).all()))
        results[spec] = per
        ref = next(iter(results.values()))
        lost = sorted(k for k in per if ref[k][1] and not per[k][1])
        print(f"{spec}: {sum(v[1] for v in per.values())}/{len(per)} right, mean log-prob "
              f"{sum(v[0] for v in per.values()) / len(per):.3f}, lost against {next(iter(results))} {lost}; "
              f"{bits:.3f} bits/elem at {a.length}; {time.process_time() - cpu0:.0f} s CPU", flush=True)
        if a.out:
            with open(a.out, "w", encoding="utf-8") as f:
                json.dump({s: {str(k): v for k, v in d.items()} for s, d in results.items()}, f)


if __name__ == "__main__":
    main()
