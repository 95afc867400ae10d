"""The PD heatmap of DeepServe Algorithm 1 (see control/je/routing/pd_policy.py).

Heatmap file (JSON, conf/pd_heatmap.json):

    {"format": "deepserve.pd_heatmap/1",
     "model": "tiny", "source": "profiled" | "placeholder" | ..., "rates": [0.5, 1.0],
     "created": "2025-01-01T00:00:00Z", "notes": "free text (optional)",
     "prompt_len_edges": [0, 256, 512, ...],      # tokens, strictly increasing
     "ratio_edges": [0, 0.0625, 0.125, ...],      # decode_len / prompt_len, increasing
     "values": [[0.12, null, ...], ...]}          # rows: prompt bins, cols: ratio bins

N+1 edges make N bins [e_i, e_i+1). A cell is JCT(colocated) / JCT(disaggregated)
- 1: positive means disaggregated is faster. null marks an unmeasured cell.
"rates" lists the request rates whose maps were summed into this one (the
paper combines per-RPS maps by element-wise addition: Heatmap.combine). Other
top-level keys are errors (typos must not pass silently); "format" may be
omitted, the metadata keys default to empty. save() writes one grid row a line.

lookup(prompt_len, decode_len) clamps: a prompt shorter than the first edge
uses the first row, one at or past the last edge the last row; the same for
the ratio. An unmeasured (null) cell returns None (no nearest-cell guess);
PDPolicy then applies the threshold rule and says so in its reason.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from deepserve.errors import DeepServeError

HEATMAP_FORMAT = "deepserve.pd_heatmap/1"


class PDConfigError(DeepServeError, ValueError):
    """Bad PD policy configuration: unknown mode, missing or malformed file."""


def _read_json(path: str | Path, what: str) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PDConfigError(f"{what} file {str(path)!r} does not exist") from None
    except (OSError, ValueError) as e:
        raise PDConfigError(f"{what} file {str(path)!r} cannot be read: {e}") from e
    if not isinstance(data, dict):
        raise PDConfigError(f"{what} file {str(path)!r} must hold a JSON object")
    return data


def _bin(edges: Sequence[float], x: float) -> int:
    """Index i with edges[i] <= x < edges[i+1], clamped to [0, len(edges) - 2]."""
    i = 0
    while i + 2 < len(edges) and x >= edges[i + 1]:
        i += 1
    return i


# -- heatmap ------------------------------------------------------------------------
@dataclass
class Heatmap:
    prompt_len_edges: list[float]
    ratio_edges: list[float]
    values: list[list[float | None]]
    model: str = ""
    source: str = ""
    rates: list[float] = field(default_factory=list)
    created: str = ""
    notes: str = ""

    def __post_init__(self):
        for name in ("prompt_len_edges", "ratio_edges"):
            edges = getattr(self, name)
            if (not isinstance(edges, list) or len(edges) < 2
                    or not all(isinstance(e, (int, float)) and math.isfinite(e) for e in edges)
                    or any(a >= b for a, b in zip(edges, edges[1:]))):
                raise PDConfigError(f"heatmap {name} must be >= 2 strictly increasing numbers, "
                                    f"got {edges!r}")
        rows, cols = len(self.prompt_len_edges) - 1, len(self.ratio_edges) - 1
        if not isinstance(self.values, list) or len(self.values) != rows or any(
                not isinstance(r, list) or len(r) != cols for r in self.values):
            raise PDConfigError(f"heatmap values must be {rows} rows (prompt bins) of {cols} "
                                "values (ratio bins)")
        for row in self.values:
            for v in row:
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                      or not math.isfinite(v)):
                    raise PDConfigError(f"heatmap cell must be a finite number or null, got {v!r}")

    @classmethod
    def load(cls, path: str | Path) -> "Heatmap":
        data = _read_json(path, "heatmap")
        if data.pop("format", HEATMAP_FORMAT) != HEATMAP_FORMAT:
            raise PDConfigError(f"heatmap file {str(path)!r}: format must be {HEATMAP_FORMAT!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        missing = sorted({"prompt_len_edges", "ratio_edges", "values"} - set(data))
        if unknown or missing:
            raise PDConfigError(f"heatmap file {str(path)!r}: unknown keys {unknown}, "
                                f"missing keys {missing}")
        try:
            return cls(**data)
        except PDConfigError as e:
            raise PDConfigError(f"heatmap file {str(path)!r}: {e}") from None

    def to_json(self) -> dict:
        return {"format": HEATMAP_FORMAT, "model": self.model, "source": self.source,
                "rates": self.rates, "created": self.created, "notes": self.notes,
                "prompt_len_edges": self.prompt_len_edges, "ratio_edges": self.ratio_edges,
                "values": self.values}

    def save(self, path: str | Path) -> None:
        """One key per line, one grid row per line: readable and diffable."""
        data = self.to_json()
        rows = ",\n  ".join(json.dumps(row) for row in data.pop("values"))
        head = "".join(f" {json.dumps(k)}: {json.dumps(v)},\n" for k, v in data.items())
        Path(path).write_text(f"{{\n{head} \"values\": [\n  {rows}\n ]\n}}\n", encoding="utf-8")

    def lookup(self, prompt_len: int, decode_len: int) -> float | None:
        """The cell of (prompt_len, decode_len / prompt_len), clamped; None if unmeasured."""
        row = _bin(self.prompt_len_edges, prompt_len)
        col = _bin(self.ratio_edges, decode_len / max(prompt_len, 1))
        return self.values[row][col]

    @classmethod
    def combine(cls, maps: Sequence["Heatmap"]) -> "Heatmap":
        """Element-wise sum over per-RPS maps of the same grid (measured cells
        only; null where no map measured the cell); rates are concatenated."""
        if not maps:
            raise PDConfigError("combine needs at least one heatmap")
        first = maps[0]
        if any(m.prompt_len_edges != first.prompt_len_edges
               or m.ratio_edges != first.ratio_edges for m in maps):
            raise PDConfigError("combine needs heatmaps with identical edges")
        values = []
        for r in range(len(first.values)):
            row = []
            for c in range(len(first.values[r])):
                cells = [m.values[r][c] for m in maps if m.values[r][c] is not None]
                row.append(sum(cells) if cells else None)
            values.append(row)
        return cls(list(first.prompt_len_edges), list(first.ratio_edges), values,
                   model=first.model, source=first.source,
                   rates=[rate for m in maps for rate in m.rates], created=first.created)

    def to_grid_text(self) -> str:
        """The grid for a person: rows prompt bins, columns d/p ratio bins."""
        def label(lo: float, hi: float) -> str:
            return "-".join(f"{e:.0f}" if e == int(e) else f"{e:.3g}" for e in (lo, hi))
        cols = [label(a, b) for a, b in zip(self.ratio_edges, self.ratio_edges[1:])]
        rows = [label(a, b) for a, b in zip(self.prompt_len_edges, self.prompt_len_edges[1:])]
        width = max(6, *(len(c) for c in cols))
        head = max(len("prompt\\d/p"), *(len(r) for r in rows))
        lines = [f"PD heatmap ({self.source or 'unknown source'}, model {self.model or '?'}, "
                 f"rates {self.rates}): JCT(colocated)/JCT(disaggregated) - 1, "
                 "+ = disaggregated faster, . = unmeasured",
                 "prompt\\d/p".ljust(head) + " " + " ".join(c.rjust(width) for c in cols)]
        for name, row in zip(rows, self.values):
            cells = ("." if v is None else f"{v:+.2f}" for v in row)
            lines.append(name.ljust(head) + " " + " ".join(c.rjust(width) for c in cells))
        return "\n".join(lines)
