"""The Redis names of heartbeats and load records under one namespace prefix: the one place
that knows them (agents write there, routers read there)."""

from __future__ import annotations

from collections.abc import Iterable


class HeartbeatKeys:
    """Redis names for heartbeats under one namespace prefix.

    - `worker(id)`: a string key holding the worker's latest heartbeat JSON, with a TTL of
      `ttl_s`, rewritten every heartbeat (what a full read of the fleet finds).
    - `loads(region)`: a hash of the region's workers' load records (worker.load_records),
      field = worker id, rewritten every heartbeat: what routers read in one go.
    - `channel`: pub/sub channel that routers follow; a message is a heartbeat JSON when
      anything but the load changed (a new worker, its state, models, capacity...), or
      `gone:<worker_id>` when a worker removes itself (drain finished).
    - `tap`: pub/sub channel with every heartbeat JSON, for people and tools watching
      the fleet (`redis-cli subscribe <prefix>:heartbeats:all`); routers do not read it.

    `sharded` (a Redis/Valkey Cluster): each region's heartbeat plane is one slot, its
    hash tag the region: `<prefix>:hb:{region}:<worker>`, `<prefix>:loads:{region}`, and
    the channels are per region and sharded, `<prefix>:heartbeats:{region}` and
    `<prefix>:heartbeats:all:{region}` (`redis-cli -c ssubscribe ...`). So an agent's
    heartbeat is one transaction on one node, and each region's traffic goes to the node
    of its slot.
    """

    GONE_PREFIX = "gone:"

    def __init__(self, prefix: str = "globalpool", *, sharded: bool = False) -> None:
        self.prefix = prefix
        self.sharded = sharded
        self.channel = f"{prefix}:heartbeats"
        self.tap = f"{prefix}:heartbeats:all"
        self.pattern = f"{prefix}:hb:*"
        self.loads_pattern = f"{prefix}:loads:*"
        self._worker_at = len(self.pattern) - 1

    def worker(self, worker_id: str, region: str | None = None) -> str:
        """The key of `worker_id`'s heartbeat (`region`: the heartbeat's, needed when
        sharded)."""
        if self.sharded:
            if not region:
                raise ValueError(f"sharded heartbeat keys need {worker_id!r}'s region")
            return f"{self.prefix}:hb:{{{region}}}:{worker_id}"
        return f"{self.prefix}:hb:{worker_id}"

    def worker_id(self, key: bytes) -> str:
        """The worker whose heartbeat key `key` is (one `pattern` matched)."""
        name = key[self._worker_at:]
        if self.sharded:
            name = name.partition(b"}:")[2]
        return name.decode(errors="replace")

    def loads(self, region: str) -> str:
        if self.sharded:
            return f"{self.prefix}:loads:{{{region}}}"
        return f"{self.prefix}:loads:{region}"

    def region_of_loads(self, key: bytes) -> str:
        """The region whose load records `key` holds (one `loads_pattern` matched)."""
        name = key[len(self.loads_pattern) - 1:]
        if self.sharded:
            name = name.removeprefix(b"{").removesuffix(b"}")
        return name.decode(errors="replace")

    def channels(self, regions: Iterable[str]) -> list[str]:
        """The channels routers follow for workers of `regions`."""
        if self.sharded:
            return [self.region_channel(region) for region in sorted(set(regions))]
        return [self.channel]

    def region_channel(self, region: str) -> str:
        """The channel a worker of `region` announces on."""
        return f"{self.channel}:{{{region}}}" if self.sharded else self.channel

    def region_tap(self, region: str) -> str:
        return f"{self.tap}:{{{region}}}" if self.sharded else self.tap

    def gone_message(self, worker_id: str) -> str:
        return f"{self.GONE_PREFIX}{worker_id}"
