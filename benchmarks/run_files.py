"""Reading the folders an ``lmc run`` leaves, for the benchmarks that measure from them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def pair_result(folder: Path) -> dict[str, Any]:
    """The result of the one reference in a sweep folder's ``lmc_results.json`` (a pair's alignment or head order)."""
    (reference,) = json.loads((folder / "lmc_results.json").read_text())["references"].values()
    return reference
