"""The keys each API defines, so that a key nobody defines is a 400 naming it, never ignored.

A key the API defines but this server does not honour is refused elsewhere by its value
(`params.Unsupported`: a 400 "not supported" unless it holds its neutral value); a key no API
defines is a typo or a feature of some other server, and answering as if it were not there
would hand back an answer to a question the client did not ask.

The lists are SGLang's `GenerateReqInput` and `SamplingParams`
(`python/sglang/srt/managers/io_struct.py`, `python/sglang/srt/sampling/sampling_params.py`),
OpenAI's Chat Completions and Completions request bodies, and the extra keys SGLang's own
OpenAI server takes beside them (`python/sglang/srt/entrypoints/openai/protocol.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hicache.runtime.serving.errors import bad_request
from hicache.runtime.serving.params import Unsupported

GENERATE = frozenset(
    {
        "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data",
        "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
        "token_ids_logprob", "return_text_in_logprobs", "stream", "log_metrics",
        "return_hidden_states", "return_routed_experts", "modalities", "session_params",
        "lora_path", "lora_id", "custom_logit_processor", "bootstrap_host", "bootstrap_port",
        "bootstrap_room", "bootstrap_pair_key", "data_parallel_rank", "background",
        "conversation_id", "priority", "extra_key", "no_logs", "custom_labels", "return_bytes",
        "return_entropy", "routing_key", "stream_options",
    }
)  # fmt: skip

SAMPLING = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
        "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
        "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
        "logit_bias", "sampling_seed", "seed",
    }
)  # fmt: skip

_OPENAI_COMMON = frozenset(
    {
        "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
        "presence_penalty", "seed", "stop", "stream", "stream_options", "temperature", "top_p",
        "user",
        # SGLang's OpenAI server takes these beside OpenAI's own
        "top_k", "min_p", "min_tokens", "regex", "ebnf", "json_schema", "repetition_penalty",
        "stop_token_ids", "no_stop_trim", "ignore_eos", "skip_special_tokens", "lora_path",
        "session_params", "rid", "return_hidden_states", "priority",
    }
)  # fmt: skip

COMPLETIONS = _OPENAI_COMMON | {"prompt", "best_of", "echo", "suffix"}

CHAT = _OPENAI_COMMON | {
    "messages", "audio", "function_call", "functions", "max_completion_tokens", "metadata",
    "modalities", "parallel_tool_calls", "prediction", "prompt_cache_key", "reasoning_effort",
    "response_format", "safety_identifier", "service_tier", "store", "tool_choice", "tools",
    "top_logprobs", "verbosity", "web_search_options",
    # SGLang's
    "continue_final_message", "chat_template_kwargs", "separate_reasoning", "stream_reasoning",
}  # fmt: skip


# Keys those APIs define that this server takes only at their neutral value (beside the ones each
# API module lists itself); a 400 "not supported" otherwise.
GENERATE_NEUTRAL = (
    Unsupported("input_embeds", (None,)),
    Unsupported("video_data", (None,)),
    Unsupported("audio_data", (None,)),
    Unsupported("token_ids_logprob", (None,)),
    Unsupported("log_metrics", (None, True)),
    Unsupported("return_hidden_states", (None, False)),
    Unsupported("return_routed_experts", (None, False)),
    Unsupported("modalities", (None, [])),
    Unsupported("lora_id", (None, "")),
    Unsupported("custom_logit_processor", (None,)),
    Unsupported("bootstrap_host", (None,)),
    Unsupported("bootstrap_port", (None,)),
    Unsupported("bootstrap_room", (None,)),
    Unsupported("bootstrap_pair_key", (None,)),
    Unsupported("data_parallel_rank", (None,)),
    Unsupported("background", (None, False)),
    Unsupported("conversation_id", (None,)),
    Unsupported("priority", (None,)),
    Unsupported("extra_key", (None,)),
    Unsupported("no_logs", (None, False)),
    Unsupported("custom_labels", (None,)),
    Unsupported("return_bytes", (None, False)),
    Unsupported("return_entropy", (None, False)),
    Unsupported("routing_key", (None,)),
)
SAMPLING_NEUTRAL = (
    Unsupported("stop_regex", (None, [])),
    Unsupported("structural_tag", (None,)),
    Unsupported("skip_special_tokens", (None, True)),
    Unsupported("spaces_between_special_tokens", (None, True)),
    Unsupported("custom_params", (None,)),
    Unsupported("stream_interval", (None, 1)),
)
OPENAI_NEUTRAL = (
    Unsupported("regex", (None,)),
    Unsupported("ebnf", (None,)),
    Unsupported("json_schema", (None,)),
    Unsupported("skip_special_tokens", (None, True)),
    Unsupported("lora_path", (None, "")),
    Unsupported("session_params", (None,)),
    Unsupported("rid", (None,)),
    Unsupported("return_hidden_states", (None, False)),
    Unsupported("priority", (None,)),
    Unsupported("audio", (None,)),
    Unsupported("function_call", (None, "none")),
    Unsupported("functions", (None, [])),
    Unsupported("modalities", (None, ["text"])),
    Unsupported("prediction", (None,)),
    Unsupported("reasoning_effort", (None,)),
    Unsupported("service_tier", (None, "auto", "default")),
    Unsupported("store", (None, False)),
    Unsupported("verbosity", (None,)),
    Unsupported("web_search_options", (None,)),
    Unsupported("tool_choice", (None, "none", "auto")),
    Unsupported("continue_final_message", (None, False)),
    Unsupported("chat_template_kwargs", (None, {})),
)


def refuse_unknown(obj: Mapping[str, Any], known: frozenset[str], where: str = "") -> None:
    """A 400 naming the first key of `obj` that `known` lacks (sorted, so the answer is stable)."""
    unknown = sorted(str(k) for k in obj if k not in known)
    if unknown:
        raise bad_request(
            f"'{where}{unknown[0]}' is not a field this API defines "
            f"({len(unknown)} unknown: {', '.join(unknown[:5])})",
            where + unknown[0],
        )
