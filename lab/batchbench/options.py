"""What one `globalpool bench-batch` run does: the phases' sizes, the workload, the config.

The stack runs the regions.yaml given (default: the repository's, whose three regions are
priced 2.50 / 2.20 / 1.60 per GPU hour), changed only where the bench must: batch files are
kept under the run's own folder.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class BatchBenchOptions:
    """One run. Times in seconds; token counts per request."""

    out: Path
    config_path: Path = Path("regions.yaml")
    lines: int = 10_000  # the batch that runs beside the interactive load
    calibration_lines: int = 1_000  # the batch that runs alone first (0: no calibration)
    baseline_s: float = 60.0  # the interactive load alone, after its warm-up
    warmup_s: float = 3.0  # interactive load before the baseline counts and the batch starts
    interactive_share: float = 0.3  # of the fleet's slots the interactive load is sized to hold
    rate_per_s: float | None = None  # interactive requests/s (default: sized by the share)
    interactive_max_tokens: int = 64
    batch_max_tokens: int = 64
    batch_timeout_s: float = 900.0  # a batch not done by then is cancelled, the run reported
    request_timeout_s: float = 60.0
    seed: int = 0
    command: str = ""

    def problems(self) -> list[str]:
        """What makes this run impossible, one line per flag (empty: none)."""
        found = []
        if self.lines < 1:
            found.append("--lines: must be at least 1")
        if self.calibration_lines < 0:
            found.append("--calibration-lines: must be 0 or more")
        if self.baseline_s <= 0 or self.warmup_s < 0:
            found.append("--baseline-s: must be > 0 (and the warm-up >= 0)")
        if not 0.0 < self.interactive_share < 0.75:
            found.append("--interactive-share: must be above 0 and below 0.75 (the slots "
                         "left to interactive traffic alone are 0.25)")
        if self.rate_per_s is not None and self.rate_per_s <= 0:
            found.append("--rate: must be > 0")
        if self.interactive_max_tokens < 1 or self.batch_max_tokens < 1:
            found.append("--interactive-max-tokens, --batch-max-tokens: must be >= 1")
        return found

    def to_json(self) -> dict[str, Any]:
        document = {name: getattr(self, name) for name in self.__dataclass_fields__}
        document["out"] = str(self.out)
        document["config_path"] = str(self.config_path)
        return document


QUICK: dict[str, Any] = {"lines": 1_000, "calibration_lines": 300, "baseline_s": 15.0,
                         "batch_timeout_s": 240.0}


def preset(options: BatchBenchOptions, *, quick: bool) -> BatchBenchOptions:
    """`options` with the --quick sizes (short phases, 1,000 lines) where asked."""
    return replace(options, **QUICK) if quick else options


def bench_config(config_path: Path, work: Path) -> Path:
    """`config_path` as the bench runs it, written under `work`: batch files in
    `work/files` (not the home directory), everything else as given."""
    document = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    files = (work / "files").resolve()
    files.mkdir(parents=True, exist_ok=True)
    batch = document.setdefault("batch", {}) or {}
    batch["storage"] = f"file://{files}"
    document["batch"] = batch
    written = work / "regions.yaml"
    written.write_text(f"# {config_path}, run by globalpool bench-batch (batch.storage "
                       "changed)\n" + yaml.safe_dump(document, sort_keys=False))
    return written
