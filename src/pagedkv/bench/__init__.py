"""Benchmark harnesses, one module per `pagedkv bench` target, out of the library layers.

- `attention`: decode / prefill attention of the fast CPU kernel over the compressed paged cache
  vs torch over bf16 (`attention_cuda`: the Triton kernels on a GPU, same sub-command);
- `offload`: bytes and read-back time per storage tier and format, vs recomputing;
- `memory`: peak resident memory of a long generation of the embedded model, per format;
- `toy`: the random-weight transformer that drives a cache end to end (tests, benchmarks).

`config` holds each target's settings as a torch-free dataclass: the CLI takes its defaults from
there. A new target: a harness module here, a CLI module under `pagedkv/cli/bench/`, one entry in
`pagedkv.cli.bench.TARGETS`. Importing this package imports nothing heavy.
"""
