"""Redis -> immutable Snapshot. The only place in the router that reads heartbeats."""

from router.registry.collector import HeartbeatCollector
from router.registry.snapshot import Snapshot, SnapshotHolder, WorkerView

__all__ = ["HeartbeatCollector", "Snapshot", "SnapshotHolder", "WorkerView"]
