"""Which addresses a region's workers may advertise (`regions.<r>.allowed_endpoints`).

An entry is a CIDR (`10.20.0.0/16`, `fd00::/8`), an IP address (one host), a host name
(`gpu-7.eu.internal`, compared case-insensitively) or a wildcard suffix
(`*.eu.internal`: any name ending in `.eu.internal`). A heartbeat whose endpoint host
matches no entry of its region's list is dropped, so nobody who can write to Redis can
point routers at an address of their choosing. Names are compared as written: the router
does not resolve DNS, so list the names the workers advertise.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

_HOST = re.compile(r"^(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*$")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# A region without `allowed_endpoints`: its workers may advertise private and loopback IP
# addresses only (where a deployment's workers are: RFC 1918, unique-local and link-local
# ranges, and loopback for one machine), so a forged heartbeat cannot point routers at an
# address on the internet. Host names and public addresses must be listed.
DEFAULT_ALLOWED_ENDPOINTS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                             "169.254.0.0/16", "127.0.0.0/8", "fc00::/7", "fe80::/10", "::1/128")


def entry_problem(entry: str) -> str | None:
    """Why `entry` is not a valid allow-list entry, or None."""
    try:
        ipaddress.ip_network(entry, strict=False)
    except ValueError:
        pass
    else:
        return None
    if _HOST.fullmatch(entry) is None:
        return f"{entry!r} is neither a CIDR, an IP address nor a host name (or *.suffix)"
    return None


@dataclass(frozen=True)
class EndpointAllowList:
    """One region's allowed worker addresses."""

    networks: tuple[Network, ...]
    hosts: frozenset[str]
    suffixes: tuple[str, ...]

    @classmethod
    def parse(cls, entries: Iterable[str]) -> EndpointAllowList:
        """Entries must have passed `entry_problem` (the config validates them)."""
        networks: list[Network] = []
        hosts: set[str] = set()
        suffixes: list[str] = []
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            if entry.startswith("*."):
                suffixes.append(entry[1:].lower())  # ".eu.internal"
            else:
                hosts.add(entry.lower())
        return cls(tuple(networks), frozenset(hosts), tuple(suffixes))

    def allows(self, endpoint: str) -> bool:
        """Whether the host of the URL `endpoint` is on the list."""
        try:
            host = urlsplit(endpoint).hostname
        except ValueError:
            return False
        if not host:
            return False
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            name = host.lower().rstrip(".")
            return name in self.hosts or any(name.endswith(s) for s in self.suffixes)
        return any(address in network for network in self.networks)
