"""TLS to the workers: one client context for every https endpoint.

Every https worker is verified the same way (the system's CA certificates, the host name
checked), and each `ssl.SSLContext` holds its own parsed copy of the CA store: ~0.9 MB
here, so one context per endpoint came to ~9 GB at 10,000 https workers. One context
serves them all; the name each connection checks is its own (`server_hostname`, passed
per connection by `UpstreamPool`). Nothing in regions.yaml sets TLS per endpoint today;
an endpoint that needs other settings would get a context of its own.
"""

from __future__ import annotations

import functools
import ssl


@functools.cache
def client_context() -> ssl.SSLContext:
    """The context of every https connection to a worker, made at first use (a router
    with only http workers never loads the CA store). Shared: never change its settings."""
    return ssl.create_default_context()
