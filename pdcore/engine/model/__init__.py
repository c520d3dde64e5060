"""The model: where it is and its tokenizer (`source`, `tokenizer`, `gguf_cache`), config and
weights (`hf_config`, `weights`, `loader`, `fingerprint`), the families over the paged KV pool
(`base`: what they share; `llama`, `mixtral`, `qwen_moe`, `deepseek`; their layers in
`layers`, `moe`, `rope`, `decode_view`; which kernel attends a prefill chunk:
`prefill_route`), the batch they run (`batch`) and one forward pass
(`runner`)."""
