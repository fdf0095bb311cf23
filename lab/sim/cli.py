"""`globalpool sim`: command-line flags -> SimConfig -> a server until SIGINT/SIGTERM.

The launcher (`globalpool up`, tests) waits for the line `sim listening on http://HOST:PORT`
on stdout; with --port 0 it carries the port that was picked.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import uvloop

from lab.sim.api import build_app
from lab.sim.config import SimConfig
from lab.sim.server import SimServer
from router.core.cli_args import port_number

__all__ = ["SimConfig", "add_sim_arguments", "build_app", "config_from_args", "run_sim"]

_DEFAULTS = SimConfig()


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the simulator's flags to `parser` (defaults are SimConfig's)."""
    d = _DEFAULTS
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    add("--port", type=port_number, required=True,
        help="TCP port; 0 picks a free one and prints it")
    add(
        "--served-model-name",
        nargs="+",
        default=list(d.served_model_names),
        metavar="NAME",
        help="model names to answer for; metrics are labelled with the first",
    )
    add("--max-num-seqs", type=int, default=d.max_num_seqs, help="batch slots")
    add("--kv-blocks", type=int, default=d.kv_blocks, help="KV-cache blocks (num_gpu_blocks)")
    add("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    add(
        "--prefill-tokens-per-s",
        type=float,
        default=d.prefill_tokens_per_s,
        help="prompt tokens computed per second",
    )
    add(
        "--decode-step-ms",
        type=float,
        default=d.decode_step_ms,
        help="decode step time with an empty batch",
    )
    add(
        "--decode-step-ms-per-seq",
        type=float,
        default=d.decode_step_ms_per_seq,
        help="extra decode step time per running sequence",
    )
    add(
        "--max-num-queued-reqs",
        type=int,
        default=d.max_num_queued_reqs,
        help="waiting requests beyond this get 503 (default: unlimited)",
    )
    add("--max-model-len", type=int, default=d.max_model_len, help="context length in tokens")
    add("--seed", type=int, default=d.seed, help="seed of output words and random faults")
    add(
        "--legacy-metrics",
        action="store_true",
        help="name KV usage vllm:gpu_cache_usage_perc, as vLLM before 0.10 did",
    )
    add(
        "--error-rate",
        type=float,
        default=d.error_rate,
        help="fraction of requests answered 500 (fault knob, changeable at /sim/faults)",
    )
    add(
        "--slow-factor",
        type=float,
        default=d.slow_factor,
        help="multiplies step times (fault knob, changeable at /sim/faults)",
    )
    add(
        "--eos-probability",
        type=float,
        default=d.eos_probability,
        help="chance per token of stopping early (finish_reason stop) unless ignore_eos",
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Raises ValueError naming the bad flag values."""
    return SimConfig(
        served_model_names=tuple(args.served_model_name),
        max_num_seqs=args.max_num_seqs,
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_step_ms=args.decode_step_ms,
        decode_step_ms_per_seq=args.decode_step_ms_per_seq,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_model_len=args.max_model_len,
        seed=args.seed,
        legacy_metrics=args.legacy_metrics,
        error_rate=args.error_rate,
        slow_factor=args.slow_factor,
        eos_probability=args.eos_probability,
    )


def run_sim(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; 0 on a clean stop, 2 on a bad configuration."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"globalpool sim: {exc}", file=sys.stderr)
        return 2
    return uvloop.run(_serve(config, args.host, args.port))


async def _serve(config: SimConfig, host: str, port: int) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    server = SimServer(config, host, port)
    try:
        await server.start()
    except OSError as exc:
        print(f"globalpool sim: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 1
    print(f"sim listening on {server.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
    return 0
