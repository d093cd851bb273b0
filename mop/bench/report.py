"""Benchmark output: an aligned text table on stdout and the full results as JSON."""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch


def table(title: str, columns: list[str], rows: list[list]) -> str:
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = "  ".join("-" * w for w in widths)
    out = [title, "  ".join(c.rjust(w) for c, w in zip(columns, widths)), line]
    out += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def write_json(path: Path, name: str, settings: dict, results: dict) -> Path:
    record = {"bench": name, "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "torch": torch.__version__,
                          "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
              "settings": settings, **results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return path


MIB = 2**20
