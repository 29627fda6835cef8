"""What the runtime's commands do: `hicache node prefill|decode`, `run --runtime` and `serve`,
and the argparse `type`s that ask the runtime what a value may be. The runtime imports torch:
it is imported inside each, where a node or a replay runs."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hicache.extras import require
from hicache.faults import FaultSpec
from hicache.runtime import cache_flags
from hicache.scenarios.scenario import load_scenario

if TYPE_CHECKING:
    from hicache.runtime.model.llama import TinyConfig
    from hicache.runtime.nodes import DecodeOptions
    from hicache.runtime.security.limits import Limits


def mmap_threshold(text: str) -> int:
    """An argparse `type` for --mmap-threshold: what glibc's mallopt takes, 0 for adaptive."""
    from hicache.runtime.malloc_tuning import MAX_MMAP_THRESHOLD

    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_MMAP_THRESHOLD:
        raise argparse.ArgumentTypeError(
            f"mmap threshold: expected 0..{MAX_MMAP_THRESHOLD} bytes, got {text!r}"
        )
    return value


def host_port(text: str) -> tuple[str, int]:
    """An argparse `type` for --prefill: HOST:PORT with a port the node can connect to."""
    from hicache.runtime.wire.prefill_address import parse

    try:
        return parse(text)  # [::1]:4464 too
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_node(args: argparse.Namespace) -> int:
    if getattr(args, "tp_size", 1) > 1:  # before torch loads: a lost rank is our one line, not a C++ trace
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from hicache.runtime import nodes
    from hicache.runtime.model.llama import TinyConfig

    _logging(args.log_level)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    model = TinyConfig(seed=args.model_seed) if args.model == "tiny" else args.model
    try:
        if args.node_command == "prefill":
            opts = nodes.PrefillOptions(
                args.port,
                args.host,
                args.engine,
                args.page_size,
                model,
                args.staging_pages,
                args.mmap_threshold,
                limits(args),
                args.secret_file,
                args.address_file,
                cache_bytes=args.cache_bytes,
                cache_host_bytes=args.cache_host_bytes,
                storage_dir=args.storage_dir,
                speeds=nodes.Speeds(
                    args.l3_read_bytes_per_s, args.compute_tokens_per_s, measure=not args.fixed_speeds
                ),
                layer_groups=args.layer_groups,
                chunk_tokens=args.chunked_prefill_size,
                step_tokens=args.max_prefill_tokens,
                dtype=args.dtype,
                kv_cache_dtype=args.kv_cache_dtype,
                device=args.device,
                base_gpu_id=args.base_gpu_id,
            )
            return nodes.main_prefill(opts)
        return nodes.main_decode(decode_options(args, model))
    except nodes.StartupError as exc:  # a port taken, prefill unreachable or refusing: its reason
        print(f"hicache node {args.node_command}: {exc}", file=sys.stderr)
        return 2


def decode_options(args: argparse.Namespace, model: TinyConfig | str) -> DecodeOptions:
    from hicache.runtime import nodes
    from hicache.runtime.wire.prefill_address import PrefillAddress

    if args.prefill is not None:
        prefill = PrefillAddress(fixed=args.prefill)
    else:
        prefill = PrefillAddress(file=args.prefill_file)
    try:
        storage_backend, storage_dir = cache_flags.storage_kind(args)
        config = cache_flags.decode_config(args)
    except cache_flags.SettingsError as exc:
        raise nodes.StartupError(str(exc)) from None
    return nodes.DecodeOptions(
        prefill,
        config,
        port=args.port,
        host=args.host,
        engine=args.engine,
        model=model,
        storage_dir=storage_dir,
        storage_capacity=args.storage_capacity,
        storage_backend="nixl" if storage_backend == "nixl" else "file",
        l2_gigabytes=cache_flags.l2_gigabytes(args),
        tick_interval=args.tick_interval,
        prefill_silence_s=args.prefill_silence_s,
        faults=FaultSpec.from_arg(args.faults) if args.faults else None,
        mmap_threshold=args.mmap_threshold,
        limits=limits(args),
        secret_file=args.secret_file,
        api_keys=args.api_keys,
        tp_rank=args.tp_rank,
        tp_store=args.tp_store,
        tp_argv=args.argv,
        collective_timeout=args.collective_timeout,
        command_log=args.command_log,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        l2_ratio=cache_flags.l2_ratio(args),
        device=args.device,
        base_gpu_id=args.base_gpu_id,
    )


def limits(args: argparse.Namespace) -> Limits:
    from hicache.runtime.security.limits import Limits

    return Limits(
        max_connections=args.max_connections,
        frame_bytes_in_flight=args.frame_bytes_in_flight,
        frame_timeout_s=args.frame_timeout,
        idle_timeout_s=args.idle_timeout,
        max_tokens=args.max_tokens,
    )


def run_runtime(args: argparse.Namespace) -> int:
    from hicache.runtime.launch import NodeFailed
    from hicache.runtime.runner import run_scenario

    scenario = load_scenario(args.scenario, args.overrides)
    out = args.out or Path("out") / f"{scenario.name}-runtime"
    try:
        return run_scenario(
            scenario,
            out,
            engine=args.engine,
            storage_dir=args.storage_dir,
            limit=args.limit,
            sequential=args.sequential,
            time_scale=args.time_scale,
            verify=not args.no_verify,
            progress=not args.quiet,
        )
    except NodeFailed as exc:  # e.g. NIXL missing: the node's own one line, and where its log is
        print(
            f"hicache run: the {exc.name} node did not start: {exc.reason} (log: {exc.log})", file=sys.stderr
        )
        return 2


def run_serve(args: argparse.Namespace) -> int:
    from hicache.runtime.serve_checks import ServeError, preflight

    if args.export_tokenizer is None:
        # Before anything loads: a bad flag or file is one line at once, not a failure after
        # the model loaded in every node.
        try:
            preflight(
                host=args.host, port=args.port, api_keys=args.api_keys, model=args.model, log_dir=args.log_dir
            )
        except ServeError as exc:
            print(f"hicache serve: {exc}", file=sys.stderr)
            return 2
    if args.export_tokenizer is None and not args.decode:
        require("torch")  # the nodes serve starts compute with it; the front door never imports it
    from hicache.runtime.lone_error import sole
    from hicache.runtime.security.api_keys import ApiKeyError
    from hicache.runtime.serve import ServeOptions, load_tokenizer, main
    from hicache.runtime.supervisor import NodeDied

    if args.export_tokenizer is not None:
        try:
            tokenizer, _ = load_tokenizer(args.model)
            out = tokenizer.save_pretrained(args.export_tokenizer)
        except (OSError, ValueError) as exc:
            print(f"hicache serve: --export-tokenizer {args.export_tokenizer}: {exc}", file=sys.stderr)
            return 2
        print(f"wrote the tokenizer of {args.model} to {out}")
        return 0
    _logging(args.log_level)
    passed_on = cache_flags.forwarded(args)
    if args.tp_size != 1:
        passed_on += ["--tp-size", str(args.tp_size)]
    if args.decode and passed_on:
        print(
            f"hicache serve: {passed_on[0]}: sets the decode node started here, but --decode attaches "
            "to one running with its own settings",
            file=sys.stderr,
        )
        return 2
    blank = [n for n in args.served_model_name if not n.strip() or not n.isprintable()]
    if blank:
        print(
            f"hicache serve: --served-model-name {blank[0]!r}: expected a printable, non-blank name",
            file=sys.stderr,
        )
        return 2
    plain = ServeOptions()
    scheduling = [
        flag
        for flag, value, default in (
            ("--chunked-prefill-size", args.chunked_prefill_size, plain.chunked_prefill_size),
            ("--max-prefill-tokens", args.max_prefill_tokens, plain.max_prefill_tokens),
        )
        if value != default
    ]
    if scheduling and (args.decode or args.prefill):
        print(
            f"hicache serve: {scheduling[0]}: sets the prefill nodes started here, but "
            f"{'--decode' if args.decode else '--prefill'} uses running ones with their own settings",
            file=sys.stderr,
        )
        return 2
    clash = (
        "--decode: attaches to running decode nodes; --prefill, --prefill-nodes and --decode-nodes start them"
        if args.decode and (args.prefill or args.prefill_nodes != 1 or args.decode_nodes != 1)
        else "--prefill-nodes: starts prefill nodes, but --prefill names running ones"
        if args.prefill and args.prefill_nodes != 1
        else None
    )
    if clash is not None:
        print(f"hicache serve: {clash}", file=sys.stderr)
        return 2
    opts = ServeOptions(
        log_level=args.log_level,
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        base_gpu_id=args.base_gpu_id,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
        host=args.host,
        port=args.port,
        engine=args.engine,
        page_size=args.page_size,
        decode=tuple(args.decode),
        prefill=tuple(args.prefill),
        prefill_nodes=args.prefill_nodes,
        decode_nodes=args.decode_nodes,
        router=args.router,
        decode_api_key=args.decode_api_key,
        api_keys=args.api_keys,
        max_tokens=args.max_tokens,
        context_length=args.context_length,
        max_queued_requests=args.max_queued_requests,
        queue_timeout_s=args.queue_timeout or None,
        max_connections=args.max_connections,
        max_body_bytes_in_flight=args.max_body_bytes_in_flight,
        body_timeout_s=args.body_timeout,
        max_requests_per_tenant=args.max_requests_per_tenant,
        max_tokens_per_minute_per_tenant=args.max_tokens_per_minute_per_tenant,
        stream_stall_timeout_s=args.stream_stall_timeout or None,
        node_restarts=args.node_restarts,
        health_check_interval_s=args.health_check_interval,
        log_dir=args.log_dir,
        extra_decode_args=tuple(passed_on),
        record_trace=args.record_trace,
        record_trace_dir=args.record_trace_dir,
        record_block_size=args.record_block_size,
        shared_open_cache=args.shared_open_cache,
        special_tokens_in_content=args.special_tokens_in_content,
        served_model_names=tuple(args.served_model_name),
    )
    try:
        return main(opts)
    except (ServeError, ApiKeyError, NodeDied, BaseExceptionGroup) as exc:
        err = sole(exc)
        if not isinstance(err, ServeError | ApiKeyError | NodeDied):
            raise
        print(f"hicache serve: {err}", file=sys.stderr)
        return 1 if isinstance(err, NodeDied) else 2
