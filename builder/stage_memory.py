"""Peak memory of a stage over one batch, measured where the stage runs .

* On a CUDA device: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``: the most memory the
  process's tensors held on that device while the stage ran (the loaded models included; ``start_bytes`` is what was
  allocated when the stage started). Per process: two workers sharing a GPU each report their own.
* On the CPU (Linux): the growth of the process's peak resident set while the stage ran. Writing ``5`` to
  ``/proc/self/clear_refs`` resets the peak (``VmHWM``) to the current resident set (``VmRSS``), so
  ``VmHWM - VmRSS(start)`` afterwards is how far the resident set rose above its starting point. It is a lower bound
  of what the stage allocated (memory the allocator already held from earlier work is reused without growth) and it
  is process-wide (the engine's decode thread prepares the next batch meanwhile), so read it as "this stage needed
  at least this much more memory", not as an exact figure.
* Elsewhere (another OS, a non-CUDA accelerator): ``None``; ``unmeasured_reason`` says why.

Entries are plain JSON: ``{"device", "measure", "peak_bytes", "start_bytes"}``, merged per device by ``merge``
(the largest ``peak_bytes`` wins), so the ledger keeps each stage's maximum over batches, resumes and workers.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CUDA_MEASURE = "cuda_max_memory_allocated"
CPU_MEASURE = "rss_peak_growth"
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _proc_status_bytes(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def unmeasured_reason(device: str) -> str | None:
    """Why the peak memory of a stage on ``device`` cannot be measured here (None when it can)."""
    kind = str(device).split(":")[0]
    if kind == "cuda":
        return None
    if kind == "cpu":
        if _proc_status_bytes("VmHWM") is None:
            return "no /proc/self/status VmHWM on this system (Linux only)"
        if not os.access(_CLEAR_REFS, os.W_OK):
            return "/proc/self/clear_refs is not writable, so the peak resident set cannot be reset per stage"
        return None
    return f"peak memory is measured on cuda and cpu devices, not {kind}"


@contextlib.contextmanager
def measure_peak(device: str) -> Iterator[dict[str, Any]]:
    """Measure the peak memory of the block on ``device``; the yielded dict is filled in on exit.

    It stays empty when nothing can be measured (see ``unmeasured_reason``), or, on the CPU, when the peak cannot be
    reset (``/proc/self/clear_refs`` not writable): a peak that includes earlier stages would be wrong.
    """
    entry: dict[str, Any] = {}
    kind = str(device).split(":")[0]
    start: int | None = None
    cuda_device = None
    if kind == "cuda":
        import torch

        if torch.cuda.is_available():
            cuda_device = torch.device(device)
            if cuda_device.index is None:
                cuda_device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.reset_peak_memory_stats(cuda_device)
            start = torch.cuda.memory_allocated(cuda_device)
    elif kind == "cpu" and unmeasured_reason(device) is None and _reset_peak_rss():
        start = _proc_status_bytes("VmRSS")
    try:
        yield entry
    finally:
        if start is not None:
            if cuda_device is not None:
                import torch

                peak = torch.cuda.max_memory_allocated(cuda_device)
                entry.update(device=str(cuda_device), measure=CUDA_MEASURE, peak_bytes=int(peak), start_bytes=start)
            else:
                high = _proc_status_bytes("VmHWM")
                if high is not None:
                    entry.update(device="cpu", measure=CPU_MEASURE, peak_bytes=max(0, high - start), start_bytes=start)


def merge(stored: dict[str, dict[str, Any]] | None, new: dict[str, dict[str, Any]] | None) -> dict[str, dict]:
    """Per device, the entry with the larger ``peak_bytes`` (``stored`` and ``new`` map device -> entry)."""
    merged = dict(stored or {})
    for device, entry in (new or {}).items():
        if device not in merged or entry["peak_bytes"] > merged[device]["peak_bytes"]:
            merged[device] = entry
    return merged


def format_bytes(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"
