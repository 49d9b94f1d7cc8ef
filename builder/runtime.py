"""How a build runs on this machine: torch threads, CUDA determinism, the versions that change outputs, quiet logs.

Bytes depend on more than the config: the packages that compute the stages (torch, diffusers, transformers,
open_clip, timm), the tool itself, and torch's intra-op thread count (1 and 2 threads give different float sums, so
different counterfactual pixels). These make the build's *environment*, stored in the ledger when a build starts:
resuming under a different one is refused (``--allow-version-change`` continues and records both in the manifest).

CUDA: the build turns on deterministic algorithms where PyTorch has them (cuDNN deterministic, no benchmark autotune,
deterministic cuBLAS workspace, ``torch.use_deterministic_algorithms(True, warn_only=True)``). Kernels without a
deterministic version (notably the fused attention backward used by null-text optimisation) still run, with a
warning, and the manifest records ``determinism`` so a reader knows GPU bytes may differ between runs and GPUs; the
release still verifies, because its hashes describe the bytes it holds. See docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from importlib import metadata as importlib_metadata
from typing import Any

logger = logging.getLogger(__name__)

TOOL_NAME = "lance-counterfactuals"
# Packages whose version can change a release's bytes (the resume key includes them).
OUTPUT_PACKAGES = ("torch", "diffusers", "transformers", "open_clip_torch", "timm")
DEFAULT_TORCH_THREADS = 1


def _version(name: str) -> str | None:
    try:
        return importlib_metadata.version(name)
    except importlib_metadata.PackageNotFoundError:
        return None


def environment(torch_threads: int) -> dict[str, Any]:
    """The build's environment: what, besides the config, decides the bytes (stored in the ledger)."""
    return {
        "tool": _version(TOOL_NAME) or "0+unknown",
        "packages": {name: _version(name) for name in OUTPUT_PACKAGES},
        "torch_threads": torch_threads,
    }


def environment_changes(before: dict[str, Any], now: dict[str, Any]) -> list[dict[str, Any]]:
    """What differs between two environments, as ``{"name", "from", "to"}`` entries."""
    changes = []
    if before.get("tool") != now.get("tool"):
        changes.append({"name": TOOL_NAME, "from": before.get("tool"), "to": now.get("tool")})
    old, new = before.get("packages", {}), now.get("packages", {})
    for name in sorted(set(old) | set(new)):
        if old.get(name) != new.get(name):
            changes.append({"name": name, "from": old.get(name), "to": new.get(name)})
    if before.get("torch_threads") != now.get("torch_threads"):
        changes.append({"name": "torch_threads", "from": before.get("torch_threads"), "to": now.get("torch_threads")})
    return changes


@contextlib.contextmanager
def torch_settings(threads: int, device: str) -> Iterator[dict[str, Any]]:
    """Set torch's intra-op threads (and, on CUDA, deterministic algorithms) for the block; restore them after.

    Yields what the manifest records under ``determinism``.
    """
    import torch

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    record: dict[str, Any] = {"device": str(device).split(":")[0]}
    restore = None
    if str(device).startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS initialises
        restore = (
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
        record.update(
            {
                "deterministic_algorithms": "where available (warn_only)",
                "cudnn_deterministic": True,
                "bit_reproducible": "same GPU model, driver, CUDA and package versions; kernels without a "
                "deterministic version (fused attention backward in null-text optimisation) may still vary",
            }
        )
    else:
        record["bit_reproducible"] = "yes, with the same package versions and torch_threads"
    try:
        yield record
    finally:
        torch.set_num_threads(previous_threads)
        if restore is not None:
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = restore[0], restore[1]
            torch.use_deterministic_algorithms(restore[2], warn_only=restore[3])


def quiet_third_party_progress() -> None:
    """Silence the progress bars libraries draw while loading or saving models ("Loading weights", "Writing model
    shards"): the build draws its own. Called before stages load (the libraries are being imported then anyway)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for module_name in ("transformers.utils.logging", "diffusers.utils.logging"):
        with contextlib.suppress(ImportError):
            module = __import__(module_name, fromlist=["disable_progress_bar"])
            module.disable_progress_bar()
    with contextlib.suppress(ImportError):
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
