"""Helpers for builder tests: deterministic source folders, configs, and running the CLI in a subprocess."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

REPO = Path(__file__).resolve().parents[1]


def photo(seed: int, size: tuple[int, int] = (48, 40)) -> Image.Image:
    """A deterministic RGB test picture (smooth gradients plus a seeded pattern)."""
    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) * 127 // max(w + h - 2, 1)], -1)
    noise = rng.integers(0, 40, size=(h, w, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def make_imagefolder(root: Path, classes: list[str], per_class: int, size=(48, 40)) -> Path:
    for c, name in enumerate(classes):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            photo(c * 1000 + i, size).save(folder / f"img_{i:03d}.png")
    return root


def write_config(path: Path, source: str, *, stages: list[dict] | None = None, **fields) -> Path:
    data = {
        "name": fields.pop("name", "test-release"),
        "version": fields.pop("version", "1.0.0"),
        "seed": fields.pop("seed", 0),
        "source": source,
        "configs": fields.pop("configs", ["original"]),
        "image_size": fields.pop("image_size", 32),
        "batch_size": fields.pop("batch_size", 4),
        "stages": stages or [],
        **fields,
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


FAKE_STAGES = [
    {
        "name": "caption",
        "type": "tests.fake_stages:FakeCaptionStage",
        "configs": ["reconstructed", "counterfactual", "lance_r"],
        "options": {},
    },
    {
        "name": "edit",
        "type": "tests.fake_stages:FakeEditStage",
        "configs": ["reconstructed", "counterfactual", "lance_r"],
        "options": {},
    },
]
ALL_CONFIGS = ["original", "reconstructed", "counterfactual", "lance_r"]
# The LANCE stages every full preset runs (demo and hardimagenet).
METHOD_STAGES = {"caption", "perturb", "label_check", "random_edit", "invert", "reconstruct", "edit", "lance_r_edit"}


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e["HF_HUB_OFFLINE"] = "1"
    return e


def cli(*args: str, check: bool = True, timeout: float | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "builder.cli", *args],
        capture_output=True,
        text=True,
        env=env(),
        cwd=REPO,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"lance-cf {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def release_files(root: Path) -> dict[str, str]:
    """sha256 of every published file of a release (the ledger work dir excluded)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not rel.startswith(".lance-cf/"):
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out
