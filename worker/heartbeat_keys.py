"""The Redis names of heartbeats and load records under one namespace prefix: the one place
that knows them (agents write there, routers read there)."""

from __future__ import annotations


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
    """

    GONE_PREFIX = "gone:"

    def __init__(self, prefix: str = "globalpool") -> None:
        self.prefix = prefix
        self.channel = f"{prefix}:heartbeats"
        self.tap = f"{prefix}:heartbeats:all"
        self.pattern = f"{prefix}:hb:*"
        self.loads_pattern = f"{prefix}:loads:*"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:hb:{worker_id}"

    def loads(self, region: str) -> str:
        return f"{self.prefix}:loads:{region}"

    def gone_message(self, worker_id: str) -> str:
        return f"{self.GONE_PREFIX}{worker_id}"
