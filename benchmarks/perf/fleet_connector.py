"""pagedkv pages shared across vLLM instances through Redis: what instance B saves, one run.

    .venv-vllm/bin/python benchmarks/perf/fleet_connector.py [--lengths 2048,4096,8064] [--json]

One redis-server on a free loopback port and vLLM instances (each its own process, one after the
other, the embedded model, `--format` pages, the connector `PagedKVConnector` on the Redis store):
- A serves one prompt of each length (distinct windows of `pydoc_data.topics`), max_tokens 1,
  publishing its pages.
- B serves, per length, A's prompt (its pages load from Redis) and a fresh prompt of the same
  length nobody served (B computes it): time to first token of each (a max_tokens=1 request's
  wall time), and their ratio. B's output tokens for A's prompt are checked against A's.
- Bytes stored per token: the records' bytes in Redis after A over the tokens they hold, the
  catalogue's page bytes per token, and the same records with bf16 pages (the catalogue's bf16
  page bytes plus the same record overhead).
- A stream sharing a long system prompt: A then serves `--stream` requests (the system prompt,
  a distinct question each, `--stream-tokens` greedy tokens, one after the other), and B, after
  its TTFT prompts, `--stream` others with the same system prompt: its first loads the prompt's
  pages from Redis; a third instance without the connector serves B's stream (vLLM's own prefix
  cache only: it computes the system prompt once). Output tokens/s over the stream.
The machine's load average and the engine threads are printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from helpers.redis_server import RedisServer  # noqa: E402

INSTANCE = os.path.join(ROOT, "tests_vllm", "fleet_instance.py")
SECRET = "fleet-benchmark-secret-0123456789"


def windows(tokenizer, lengths, count_each=2, extra=0):
    """Distinct token windows of pydoc's topics text: count_each of every length."""
    import pydoc_data.topics as t

    text = "\n\n".join(t.topics[k] for k in sorted(t.topics))
    ids = tokenizer(text)["input_ids"]
    out, pos = [], 0
    for n in lengths:
        group = []
        for _ in range(count_each):
            group.append(ids[pos:pos + n])
            pos += n + extra
        out.append(group)
    assert pos < len(ids), "the text is too short for these lengths"
    return out


def instance(spec: dict, workdir: str, name: str, threads: int) -> list[dict]:
    path = os.path.join(workdir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
               OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, INSTANCE, path], capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"instance {name} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["results"]


def record_bytes(server) -> tuple[int, int]:
    """(records, total bytes) under the benchmark's key prefix."""
    keys = server.client.keys("pagedkv:*")
    return len(keys), sum(server.client.strlen(k) for k in keys)


def per_token_bytes(fmt: str, block_size: int, layers: int = 30, heads: int = 3, dim: int = 64) -> dict:
    """The catalogue's page bytes per token of `fmt` (its high-precision layers included) and bf16."""
    from pagedkv.formats import parse_format
    from pagedkv.integrations.vllm.layout import layer_formats, page_bytes
    from pagedkv.integrations.vllm.settings import parse_settings

    s = parse_settings(fmt, environ={})
    fmts = layer_formats(s.kv_format, s.high_precision_layers, s.hp_format, layers, [(heads, dim)] * layers)
    pages = sum(page_bytes(f, block_size, heads, dim) for f in fmts) / block_size
    bf16 = layers * page_bytes(parse_format("bf16"), block_size, heads, dim) / block_size
    return {"pages": pages, "bf16_pages": bf16}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.environ.get("PAGEDKV_VLLM_MODEL",
                                                      os.path.join(ROOT, ".venv-vllm", "smollm2-hf")))
    ap.add_argument("--format", default="turbo3")
    ap.add_argument("--lengths", default="2048,4096,8064",
                    help="prompt tokens (8064: 8k within the model's 8192 positions, room for the output)")
    ap.add_argument("--stream", type=int, default=4, help="requests per instance in the shared-prompt stream")
    ap.add_argument("--system-tokens", type=int, default=4096)
    ap.add_argument("--stream-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--raw", help="also write every instance's results to this JSON file")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    lengths = [int(x) for x in args.lengths.split(",")]
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = windows(tok, lengths + [args.system_tokens], count_each=2)
    system = prompts[-1][0]
    questions = windows(tok, [48] * (2 * args.stream), count_each=1)
    stream_a = [system + q[0] for q in questions[:args.stream]]
    stream_b = [system + q[0] for q in questions[args.stream:]]
    engine = {"model": args.model, "max_model_len": max(lengths + [args.system_tokens + 48]) + args.stream_tokens + 8,
              "kv_cache_memory_bytes": 512 << 20}
    pk = {"kv_format": args.format}
    with tempfile.TemporaryDirectory() as work:
        with open(os.path.join(work, "secret"), "w") as f:
            f.write(SECRET)
        server = RedisServer(work)
        if server.exe is None:
            sys.exit("redis-server is not installed (Debian: apt-get install redis-server)")
        server.start()
        try:
            store = {"store": "redis", "redis_url": server.url, "store_secret_file": os.path.join(work, "secret")}
            one = {"max_tokens": 1}
            stream = lambda ps: [{"prompts": [p], "max_tokens": args.stream_tokens} for p in ps]  # noqa: E731
            a = instance({"pagedkv": pk, "store": store, "engine": engine,
                          "steps": [dict(one, prompts=[g[0]]) for g in prompts[:-1]] + stream(stream_a)},
                         work, "A", args.threads)
            records, stored = record_bytes(server)
            b_steps = []
            for g in prompts[:-1]:
                b_steps += [dict(one, prompts=[g[0]]), dict(one, prompts=[g[1]])]
            b = instance({"pagedkv": pk, "store": store, "engine": engine, "steps": b_steps + stream(stream_b)},
                         work, "B", args.threads)
            without = instance({"pagedkv": pk, "store": None, "engine": engine, "steps": stream(stream_b)},
                               work, "B-alone", args.threads)
        finally:
            server.kill()
    if args.raw:
        with open(args.raw, "w") as f:
            json.dump({"A": a, "B": b, "alone": without, "records": records, "stored": stored}, f)
    # A's records: its prompts' whole blocks and the system prompt's (the stream's suffixes are < 1 block)
    tokens_stored = sum(len(g[0]) // 128 * 128 for g in prompts[:-1]) + (len(system) + 48) // 128 * 128
    with_c = b[2 * len(lengths):]
    rows = []
    for i, n in enumerate(lengths):
        hit, fresh = b[2 * i], b[2 * i + 1]
        assert hit["tokens"] == a[i]["tokens"], (n, hit["tokens"], a[i]["tokens"])
        rows.append({"tokens": n, "loaded_tokens": hit["cached"][0], "ttft_hit_s": hit["seconds"],
                     "ttft_compute_s": fresh["seconds"], "speedup": fresh["seconds"] / hit["seconds"]})
    bpt = per_token_bytes(args.format, 128)
    stream = {name: sum(len(r["tokens"][0]) for r in runs) / sum(r["seconds"] for r in runs)
              for name, runs in (("with_connector", with_c), ("without", without))}
    report = {"format": args.format, "ttft": rows, "records": records,
              "stored_bytes_per_token": stored / max(tokens_stored, 1),
              "page_bytes_per_token": bpt["pages"], "bf16_page_bytes_per_token": bpt["bf16_pages"],
              "bf16_record_bytes_per_token": bpt["bf16_pages"] + stored / max(tokens_stored, 1) - bpt["pages"],
              "stream_tok_s": stream, "load": os.getloadavg(), "threads": args.threads}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"pagedkv connector over Redis, {args.format} pages, {args.threads} thread(s) per engine, "
          f"load {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("prompt tokens | loaded by B | B TTFT, A served it (s) | B TTFT, computing (s) | speedup")
    for r in rows:
        print(f"{r['tokens']:>13} | {r['loaded_tokens']:>11} | {r['ttft_hit_s']:>22.2f} | "
              f"{r['ttft_compute_s']:>21.2f} | {r['speedup']:>6.1f}x")
    spt = report["stored_bytes_per_token"]
    print(f"stored bytes per token: {spt:.1f} (pages {bpt['pages']:.1f} + record overhead "
          f"{spt - bpt['pages']:.1f}); with bf16 pages {report['bf16_record_bytes_per_token']:.1f}: "
          f"{report['bf16_record_bytes_per_token'] / spt:.2f}x more")
    print(f"shared {args.system_tokens}-token system prompt, B's {args.stream} requests: "
          f"{stream['with_connector']:.2f} output tok/s with the connector, {stream['without']:.2f} without "
          f"({stream['with_connector'] / stream['without']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
