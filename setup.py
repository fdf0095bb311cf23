"""The build: pure Python, or with the request path compiled (GLOBALPOOL_COMPILE=1).

`GLOBALPOOL_COMPILE=1 pip install .` compiles the modules every proxied request runs
through with mypyc (the same type-annotated source, as C extension modules next to it; a
C compiler and Python's headers are needed). Everything else, and the whole project in a
plain `pip install`, stays Python. The compiled build is the one to deploy: BENCHMARKS.md
("Proxy cost") measures both. An editable install is never compiled (an edited module
would be shadowed by its stale extension), so `pip install -e .` with the variable set is
refused; `globalpool compile` builds a compiled copy of a checkout for tests and benches.
"""

import os
import sys

from setuptools import setup

# The request path: what a proxied request executes between its head arriving and its
# answer leaving, and the fleet view it reads (`router/registry/worker_view.py`: the views a
# router makes from 10,000 workers' load records; `snapshot.py`: the snapshots built of them).
# `router/core/errors.py` (an aiohttp middleware) and `site.py` (an aiohttp subclass) are
# not compilable as they are and not per request. `router/registry/collector.py` compiles,
# but the compiled tier's first router test then crashed (a segmentation fault: a task
# woken by a future whose result had been freed; mypy 2.4's mypyc), so it stays Python, and
# so do the parts it holds (`router/registry/`: worker_table, messages, load_records,
# full_read, publishing, pace, refusals).
COMPILED_MODULES = [
    "router/config_reload.py",
    "router/core/outcome.py",
    "router/core/parse.py",
    "router/health/penalties.py",
    "router/health/stalls.py",
    "router/health/tracker.py",
    "router/policy/__init__.py",
    "router/policy/affinity.py",
    "router/policy/base.py",
    "router/policy/baselines.py",
    "router/policy/filters.py",
    "router/policy/predicted_ttft.py",
    "router/policy/request.py",
    "router/proxy/exchange.py",
    "router/proxy/failures.py",
    "router/proxy/front.py",
    "router/proxy/front_exchange.py",
    "router/proxy/front_head.py",
    "router/proxy/handlers.py",
    "router/proxy/hedging.py",
    "router/proxy/replies.py",
    "router/proxy/retries.py",
    "router/proxy/routing_hints.py",
    "router/proxy/send.py",
    "router/proxy/stream.py",
    "router/proxy/stream_failover.py",
    "router/proxy/targets.py",
    "router/proxy/timeouts.py",
    "router/proxy/transcript.py",
    "router/proxy/unary.py",
    "router/proxy/upstream/buffer.py",
    "router/proxy/upstream/chunks.py",
    "router/proxy/upstream/connection.py",
    "router/proxy/upstream/decoder.py",
    "router/proxy/upstream/errors.py",
    "router/proxy/upstream/pool.py",
    "router/proxy/upstream/request.py",
    "router/proxy/upstream/response_head.py",
    "router/proxy/upstream/sinks.py",
    "router/proxy/worker_auth.py",
    "router/registry/drained.py",
    "router/registry/inflight.py",
    "router/registry/snapshot.py",
    "router/registry/worker_view.py",
    "router/telemetry/fleet.py",
    "router/telemetry/metrics.py",
    "router/telemetry/series.py",
    "router/telemetry/window.py",
]


# The commands pip runs this file for before it builds (the build's requirements, then
# the metadata): they build nothing, and mypyc, which runs when its extensions are
# declared, took ~25 s for each, a third of a compiled `pip install .`.
_DESCRIBE_ONLY = {"egg_info", "dist_info"}


def _command() -> str | None:
    """The setup command this run was given (the first argument that is no option)."""
    return next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)


def _ext_modules() -> list:
    if os.environ.get("GLOBALPOOL_COMPILE") != "1":
        return []
    if "editable_wheel" in sys.argv:
        raise SystemExit(
            "GLOBALPOOL_COMPILE=1: the compiled build is not editable (an edited module "
            "would be shadowed by its stale extension); use `pip install .`, or "
            "`globalpool compile --out DIR` for a compiled copy of this checkout")
    if _command() in _DESCRIBE_ONLY:
        return []
    from mypyc.build import mypycify  # a build requirement (pyproject.toml)

    # Type-checked on its own: the build environment has mypy but not the dependencies
    # (their types are Any to the compiler; `mypy` in CI checks them strictly), and not
    # pyproject's pydantic plugin.
    options = ["--config-file", os.devnull, "--ignore-missing-imports",
               "--python-version", "3.11"]
    return mypycify([*options, *COMPILED_MODULES], opt_level="3")


setup(ext_modules=_ext_modules())
