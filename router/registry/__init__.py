"""Redis -> immutable Snapshot. The only place in the router that reads heartbeats."""

from router.registry.collector import HeartbeatCollector
from router.registry.snapshot import Snapshot, SnapshotHolder
from router.registry.worker_view import WorkerView

__all__ = ["HeartbeatCollector", "Snapshot", "SnapshotHolder", "WorkerView"]
