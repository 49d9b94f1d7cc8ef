"""timm's published accuracies on ImageNet and its real distribution shifts, shipped as package data.

``evaluation/data/timm_shift_top1.csv`` holds, per pretrained timm model, the top-1 accuracy that timm's own
``results/`` tables publish on ImageNet-1k validation, ImageNet-V2 (matched frequency), ImageNet-R, ImageNet-Sketch and
ImageNet-A (huggingface/pytorch-image-models, ``results/results-*.csv``, Apache-2.0; each measured by timm's
validate.py at the model's own resolution and crop). Only those columns are shipped; the commit they come from is in
``evaluation/data/TIMM_RESULTS_SOURCE.md``.

Refresh from a newer timm checkout::

    python -m evaluation.timm_results PATH/TO/pytorch-image-models/results --commit <timm commit>
"""

from __future__ import annotations

import argparse
import csv
import logging
from functools import lru_cache
from pathlib import Path

from builder.release_format.text_out import write_csv

logger = logging.getLogger(__name__)

DATA_DIR = Path(__file__).with_name("data")
TABLE_PATH = DATA_DIR / "timm_shift_top1.csv"
SOURCE_PATH = DATA_DIR / "TIMM_RESULTS_SOURCE.md"

# column of the shipped table -> timm results file
TIMM_FILES = {
    "imagenet": "results-imagenet.csv",
    "imagenetv2": "results-imagenetv2-matched-frequency.csv",
    "imagenet_r": "results-imagenet-r.csv",
    "sketch": "results-sketch.csv",
    "imagenet_a": "results-imagenet-a.csv",
}
SHIFTS = {
    "imagenetv2": "ImageNet-V2",
    "imagenet_r": "ImageNet-R",
    "sketch": "ImageNet-Sketch",
    "imagenet_a": "ImageNet-A",
}
SOURCE_NOTE = (
    "timm results tables (huggingface/pytorch-image-models results/, Apache-2.0)"  # shown wherever they are used
)


@lru_cache(maxsize=1)
def load_shift_table() -> dict[str, dict[str, float]]:
    """``{timm model name: {"imagenet": top1, "imagenetv2": top1, ...}}`` for models with all five figures."""
    table: dict[str, dict[str, float]] = {}
    with open(TABLE_PATH, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            table[row["model"]] = {column: float(row[column]) for column in TIMM_FILES}
    return table


def refresh(results_dir: Path, out: Path = TABLE_PATH) -> int:
    """Rebuild the shipped table from a timm checkout's ``results/`` folder; returns the number of models written.

    Only models present in all five files are kept, in the order of ``results-imagenet.csv``.
    """
    columns: dict[str, dict[str, str]] = {}
    order: list[str] = []
    for column, filename in TIMM_FILES.items():
        path = Path(results_dir) / filename
        if not path.is_file():
            raise ValueError(f"{path} does not exist; pass the results/ folder of a timm checkout")
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            if not {"model", "top1"} <= set(reader.fieldnames or ()):
                raise ValueError(f"{path} has no model/top1 columns; is it one of timm's results tables?")
            values = {row["model"]: row["top1"] for row in reader}
        columns[column] = values
        if column == "imagenet":
            order = list(values)
    keep = [m for m in order if all(m in columns[c] for c in TIMM_FILES)]
    out.parent.mkdir(parents=True, exist_ok=True)
    import pandas as pd  # lazy: a heavy import for one table

    rows = [[model, *(f"{float(columns[c][model]):.3f}" for c in TIMM_FILES)] for model in keep]
    write_csv(pd.DataFrame(rows, columns=["model", *TIMM_FILES]), out)
    load_shift_table.cache_clear()
    return len(keep)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Refresh evaluation/data/timm_shift_top1.csv from timm's results/.")
    parser.add_argument("results_dir", type=Path, help="the results/ folder of a pytorch-image-models checkout")
    parser.add_argument("--commit", required=True, help="the timm commit the tables come from (recorded)")
    parser.add_argument("--out", type=Path, default=TABLE_PATH)
    args = parser.parse_args(argv)
    count = refresh(args.results_dir, args.out)
    SOURCE_PATH.write_text(
        "# Source of timm_shift_top1.csv\n\n"
        "Top-1 columns of the `results/` tables of timm (huggingface/pytorch-image-models), commit "
        f"{args.commit}, licensed Apache-2.0 like timm itself: {', '.join(TIMM_FILES.values())}. Only models present "
        f"in all five tables ({count}). Regenerate with `python -m evaluation.timm_results PATH/results --commit SHA`.\n",
        encoding="utf-8",
    )
    print(f"wrote {count} models to {args.out}")  # noqa: T201 - a command-line tool
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
