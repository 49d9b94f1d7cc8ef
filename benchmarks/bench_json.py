"""Machine-readable benchmark results: every benchmark's ``--json PATH`` writes through :func:`write_json`.

The file is replaced atomically (written beside, then renamed), so a benchmark killed mid-run by the GPU suite's time
budget leaves the last complete snapshot of its results, never a truncated file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` atomically (no-op when ``path`` is None)."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
