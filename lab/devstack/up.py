"""`globalpool up`: start the local stack, say what runs where, stop it all on Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import tempfile
from pathlib import Path

from lab.devstack.stack import LocalStack, StackError
from lab.devstack.valkey import EmbeddedRedisError
from router.config import GlobalConfig


def _say(line: str) -> None:
    print(line, flush=True)


def summary(stack: LocalStack) -> str:
    config = stack.config
    model = config.models[0]
    lines = ["", "globalpool is up. What runs where:", ""]
    lines.append(f"  {'role':<8} {'name':<22} {'region':<10} {'pid':>7}  address")
    if stack.valkey is not None:
        lines.append(f"  {'redis':<8} {'valkey (embedded)':<22} {'-':<10} "
                     f"{stack.valkey.pid:>7}  {stack.redis_url}")
    for child in stack.children:
        address = f"beside {child.url}" if child.role == "worker" else child.url or ""
        lines.append(f"  {child.role:<8} {child.name:<22} {child.region or '-':<10} "
                     f"{child.pid:>7}  {address}")
    url = stack.router_url
    lines += [
        "",
        f"Router: {url}  (region {config.router.region}; models: {', '.join(config.models)})",
        f"Logs:   {stack.log_dir}",
        "",
        "Try it:",
        f"  curl -s {url}/v1/models",
        f"  curl -sN {url}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f"    -d '{{\"model\": \"{model}\", \"stream\": true, "
        "\"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}' -i",
        "",
        "  python - <<'EOF'",
        "  from openai import OpenAI",
        f"  client = OpenAI(base_url=\"{url}/v1\", api_key=\"unused\")",
        "  reply = client.chat.completions.with_raw_response.create(",
        f"      model=\"{model}\", messages=[{{\"role\": \"user\", \"content\": \"Hello!\"}}])",
        "  print(reply.headers[\"x-globalpool-region\"], reply.headers[\"x-globalpool-worker\"])",
        "  print(reply.parse().choices[0].message.content)",
        "  EOF",
        "",
        f"  globalpool batch --router {url} submit requests.jsonl   # Batch API, spare slots",
        "",
        "(the workers are simulated: `globalpool sim` stands in for vLLM on machines without GPUs)",
        "Press Ctrl-C to stop everything.",
    ]
    return "\n".join(lines)


async def _serve(stack: LocalStack, state_file: Path | None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        _say(f"starting globalpool on this machine ({stack.steps_total} steps)")
        try:
            await stack.start()
        except StackError as exc:
            print(f"globalpool up failed: {exc}", file=sys.stderr, flush=True)
            return 1
        if state_file is not None:
            stack.write_state(state_file)
        _say(summary(stack))
        reported: set[int] = set()
        while not stop.is_set():
            for child in stack.exited():
                if child.pid not in reported:
                    reported.add(child.pid)
                    _say(f"note: {child.role} {child.name} (pid {child.pid}) exited with "
                         f"{child.process.returncode}; see {child.log_path}")
            if not await _valkey_kept(stack, state_file):
                return 1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await stop.wait()
        _say("stopping: router, workers (drain), simulators, valkey ...")
        return 0
    finally:
        await stack.stop()
        _say("stopped; no child process left running")


async def _valkey_kept(stack: LocalStack, state_file: Path | None) -> bool:
    """If the embedded Valkey died, say so and start it again on its port (its data is
    gone, as after any crash without persistence: agents publish again at their next
    heartbeat, routers restore their drains). False: it could not be restarted (`up`
    then stops, having said why)."""
    valkey = stack.valkey
    if valkey is None or valkey.process.poll() is None:  # poll() also reaps it
        return True
    _say(f"note: valkey (pid {valkey.pid}) exited with {valkey.process.returncode}; "
         f"starting it again on port {valkey.port} (its data is lost; agents publish "
         "again within a heartbeat)")
    try:
        await stack.start_redis()
    except (EmbeddedRedisError, OSError) as exc:
        print(f"globalpool up: valkey could not be restarted: {exc}; stopping",
              file=sys.stderr, flush=True)
        return False
    if state_file is not None:  # before the note: whoever reads the note finds the new pid
        stack.write_state(state_file)
    _say(f"valkey running again (pid {stack.valkey.pid if stack.valkey else '?'})")
    return True


def run_up(args: argparse.Namespace, config: GlobalConfig) -> int:
    from router.event_loop import new_event_loop

    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="globalpool-"))
    stack = LocalStack(
        config,
        Path(args.config),
        host=args.host or config.router.host,
        port=args.port if args.port is not None else config.router.port,
        log_dir=log_dir,
        progress=_say,
    )
    state_file = Path(args.state_file) if args.state_file else None
    loop = new_event_loop()
    try:
        return loop.run_until_complete(_serve(stack, state_file))
    finally:
        loop.close()
        if state_file is not None:
            state_file.unlink(missing_ok=True)
