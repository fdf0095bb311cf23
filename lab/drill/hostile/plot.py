"""matrix.png: one square per cell (worker fault x client behaviour), coloured by the
worst goal it missed, with its lost requests and detect_s written in it.

matplotlib with the Agg backend (no display); imported only when a report is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# green: every goal met; amber: only detection, ejection or memory missed; red: requests
# lost or 5xx the router caused; grey: not run.
_MET, _SLOW, _BROKEN, _NOT_RUN = 0, 1, 2, 3
_COLOURS = ["#8fd18f", "#f5c76b", "#e8736c", "#eeeeee"]
_BROKEN_GOALS = {"lost", "refusals_missed", "router_5xx"}


def _grade(cell: dict[str, Any]) -> int:
    missed = set(cell["goals_missed"])
    if missed & _BROKEN_GOALS:
        return _BROKEN
    return _SLOW if missed else _MET


def _label(cell: dict[str, Any]) -> str:
    detect = cell["detect_s"]
    lines = [f"lost {cell['lost']}", "detect -" if detect is None else f"detect {detect:.1f}s"]
    if not cell["exercised"]:
        lines.append("not exercised")
    if cell.get("refusals_missed"):
        lines.append(f"no 413: {cell['refusals_missed']}")
    if cell["router_5xx"]:
        lines.append(f"5xx {cell['router_5xx']}")
    if cell["healthy_ejected"]:
        lines.append(f"ejected {cell['healthy_ejected']}")
    return "\n".join(lines)


def matrix_png(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    faults, clients = report["worker_faults"], report["client_behaviours"]
    by_key = {(c["worker_fault"], c["client_behaviour"]): c for c in report["cells"]}
    grades = [[_grade(by_key[(f, c)]) if (f, c) in by_key else _NOT_RUN for c in clients]
              for f in faults]
    figure, ax = plt.subplots(figsize=(1.5 * len(clients) + 3, 0.75 * len(faults) + 2))
    ax.imshow(grades, cmap=ListedColormap(_COLOURS), vmin=0, vmax=len(_COLOURS) - 1,
              aspect="auto")
    for row, fault in enumerate(faults):
        for column, client in enumerate(clients):
            cell = by_key.get((fault, client))
            if cell is not None:
                ax.text(column, row, _label(cell), ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(clients)), [c.replace("_", "\n") for c in clients], fontsize=8)
    ax.set_yticks(range(len(faults)), faults, fontsize=8)
    ax.set_xlabel("client behaviour")
    ax.set_ylabel("worker fault")
    ax.set_title(f"globalpool drill hostile: {report['cells_met']} of {len(report['cells'])} "
                 "cells meet every goal (green; amber: detection, ejection or memory "
                 "missed; red: requests lost or router 5xx)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
