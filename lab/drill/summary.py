"""One table over several drills' report.json files (for DRILLS.md).

    python -m lab.drill.summary docs/drills            # the table
    python -m lab.drill.summary --render docs/drills   # redraw report.md, timeline.png
    python -m lab.drill.summary --reanalyze DIR        # recompute from requests.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _number(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}{unit}" if abs(value) < 100 else f"{value:.0f}{unit}"
    return f"{value}{unit}"


def table(folder: Path) -> str:
    lines = [
        "| drill | requests | failed before first byte | failed mid-stream (on target) "
        "| time to detect | time to reroute | TTFT P99 before / during / after | goals |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(folder.glob("*/report.json")):
        report = json.loads(path.read_text())
        if "failed" not in report:
            continue  # not a failover drill's (the hostile matrix, the slow-reader bench)
        failed = report["failed"]
        ttft = report["ttft_p99_ms"]
        missed = [g["goal"] for g in report["goals"] if not g["met"]]
        lines.append(
            f"| [{path.parent.name}]({path.parent.name}/report.md) | {report['requests']} | "
            f"{failed['before_first_byte']} | {failed['mid_stream']} "
            f"({report['mid_stream_failures']['on_target']}) | "
            f"{_number(report['time_to_detect_s'], ' s')} | "
            f"{_number(report['time_to_reroute_s'], ' s')} | "
            + " / ".join(_number(ttft[p], " ms") for p in ("before", "during", "after"))
            + f" | {'all met' if not missed else 'missed: ' + '; '.join(missed)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`FOLDER`: print the table. First, `--render`: redraw every report.md and
    timeline.png from its report.json (after a change to how reports look);
    `--reanalyze`: recompute every report from its raw records (after a change of
    definitions)."""
    args = sys.argv[1:] if argv is None else argv
    mode = args[0] if args[:1] in (["--render"], ["--reanalyze"]) else None
    if mode is not None:
        args = args[1:]
    if len(args) != 1:
        print("usage: python -m lab.drill.summary [--render|--reanalyze] FOLDER",
              file=sys.stderr)
        return 2
    folder = Path(args[0])
    if mode is not None:
        from lab.drill.report import reanalyze, rerender

        for path in sorted(folder.glob("*/report.json")):
            if mode == "--reanalyze" and (path.parent / "requests.jsonl").exists():
                reanalyze(path.parent)
            else:
                rerender(path.parent)
    print(table(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
