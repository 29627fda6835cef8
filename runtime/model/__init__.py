"""The model (`hicache.runtime.model`): one Llama-family decoder that computes real K/V, tiny or
real (`llama`, with its architecture in `llama_config`, its weights in `llama_weights`, the
block's arithmetic in `attention`, where K/V lives in `kv_places`, pages cut and joined in
`kv_pages`, and the checks of a paged batch in `paged_inputs`), one rank's tensor-parallel shard
of it (`tp_model`), checkpoints read from a GGUF file or a Hugging Face folder (`gguf_file`,
`hf_dir`, both behind `loader`; the file's place and GGUF header without torch, for the front
door, in `model_file`), tokenizers and chat templates (`tokenizer`, `chat_template`),
and per-request sampling (`sampling`). Beside `kv`, the bottom of the runtime: it imports no
other package of `hicache.runtime`, only the core, the shared modules and its libraries (torch,
gguf, safetensors, tokenizers, jinja2)."""
