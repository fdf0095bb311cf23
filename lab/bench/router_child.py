"""A router replica whose connections to workers leave from its region's loopback address.

    python -m lab.bench.router_child --source-host 127.0.2.1 router --region eu-west ...

On one machine every region's emulated network (lab.devstack.netem) tells router
replicas apart by the address their connections come from, so that a replica in eu-west
and one in us-east see different RTTs to the same workers. Connections to 127.0.X.1 leave
from 127.0.0.1 unless the client binds another address, which `globalpool router` has no
option for; this wrapper makes the upstream pool (and every aiohttp connector) of the
process bind the given address, then runs `globalpool` with the remaining arguments.
Bench tooling only: a real deployment has real addresses.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import aiohttp

from router.proxy.upstream.pool import UpstreamPool


def bind_connectors(source_host: str) -> None:
    """Make every `UpstreamPool` (the request path) and `aiohttp.TCPConnector` created
    from now on bind `source_host`."""
    _default_keyword(aiohttp.TCPConnector, "local_addr", (source_host, 0))
    _default_keyword(UpstreamPool, "local_host", source_host)


def _default_keyword(cls: type, name: str, value: Any) -> None:
    """`cls(...)` gets `name=value` unless the caller passes its own."""
    original = getattr(cls, "__init__")  # noqa: B009 (mypy: __init__ on a type)

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault(name, value)
        original(self, *args, **kwargs)

    setattr(cls, "__init__", init)  # noqa: B010 (mypy: no method assign)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "--source-host":
        print("usage: python -m lab.bench.router_child --source-host ADDR router ...",
              file=sys.stderr)
        return 2
    bind_connectors(args[1])
    from router.cli import main as globalpool

    return globalpool(args[2:])


if __name__ == "__main__":
    sys.exit(main())
