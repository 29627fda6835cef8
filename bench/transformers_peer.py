"""transformers as a peer in `bench/serve_vs_llamacpp.py`: the same figures, measured on
`model.generate` in this process (transformers has no server of its own that takes token-id
prompts and `ignore_eos`), printed as one JSON line for the parent to merge with the memory
it sampled from outside.

- tokens/s at concurrency c: one batched `generate` of c random-id prompts of `--prompt` tokens
  (one length, so no padding), `--new` tokens each, EOS disabled; c * new over the call's wall
  time, prefill included (as the servers' figure includes it);
- TTFT of an n-token prompt: `generate(max_new_tokens=1)`;
- multi-turn: the same chats as the servers get. transformers keeps no prefix cache across calls,
  so every turn computes its whole history: `mt_later` shows what a cache saves elsewhere.

    python bench/transformers_peer.py --dtype float32 --threads 1 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

VOCAB_LOW, VOCAB_HIGH = 100, 49000  # as serve_vs_llamacpp.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--ttft", type=int, nargs="*", default=[512, 2000])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from hicache.runtime.model.model_file import default_model_path

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    src = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=getattr(torch, args.dtype)
    ).eval()
    model.generation_config.eos_token_id = None  # never stop early, as `ignore_eos`
    model.generation_config.pad_token_id = 0
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]

    def generate(prompts: list[list[int]], new: int) -> float:
        batch = torch.tensor(prompts)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=new, do_sample=False)
        return time.perf_counter() - start

    out: dict[str, float] = {}
    generate([ids(16)], 4)  # warm up
    for c in args.concurrency:
        out[f"tok_s_c{c}"] = c * args.new / generate([ids(args.prompt) for _ in range(c)], args.new)
        print(f"  transformers c={c}: {out[f'tok_s_c{c}']:.2f} tok/s", file=sys.stderr, flush=True)
    for n in args.ttft:
        out[f"ttft_{n}"] = generate([ids(n)], 1)
        print(f"  transformers ttft {n}: {out[f'ttft_{n}']:.3f} s", file=sys.stderr, flush=True)
    if args.turns > 0:
        chats: list[list[int]] = [[] for _ in range(args.conversations)]
        first, later = [], []
        for turn in range(args.turns):
            for chat in chats:
                chat += ids(args.turn_tokens)
                (later if turn else first).append(generate([chat], 1))
        out["mt_first"] = sum(first) / len(first)
        out["mt_later"] = sum(later) / max(1, len(later))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
