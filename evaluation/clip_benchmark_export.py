"""``lance-cf export clip-benchmark RELEASE OUT``: a release as a CLIP_benchmark ``wds/`` dataset.

CLIP_benchmark (LAION-AI/CLIP_benchmark, ``clip_benchmark/datasets/builder.py``, ``build_wds_dataset``) reads a
WebDataset folder laid out as ``DATA_DIR/<split>/nshards.txt`` plus shards named ``0.tar`` .. ``N-1.tar``, and
``DATA_DIR/classnames.txt`` / ``zeroshot_classification_templates.txt`` (``{c}`` marks the class name) /
``dataset_type.txt``. A release keeps its shards as ``data/<config>/test-NNNNNN.tar`` (the Hugging Face ``datasets``
layout) and has no ``nshards.txt``, so CLIP_benchmark cannot read it as is: the shard names and the split folders
differ. The export writes that layout with every config as a split (``--dataset wds/NAME --dataset_root OUT
--split counterfactual``); the shards are the release's own bytes (hard links where the file system allows, else
copies), whose samples already hold the image (``png``/``jpg``/``webp``) and the label (``cls``) CLIP_benchmark reads.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from builder.release_format.layout import WORK_DIR
from builder.release_format.lock import declare_output


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``export clip-benchmark``."""
    p = subparsers.add_parser("export", help="write a release in another tool's layout")
    sub = p.add_subparsers(dest="export_format", required=True, metavar="FORMAT")
    cb = sub.add_parser(
        "clip-benchmark",
        help="a CLIP_benchmark wds/ dataset (every config a split)",
        description=__doc__.split("\n\n", 1)[1],
    )
    cb.add_argument("release", metavar="RELEASE", help="release directory or Hub dataset ORG/NAME[@REVISION]")
    cb.add_argument("output", metavar="OUT", type=Path, help="output directory (created; must be empty or absent)")
    cb.add_argument("--templates", default="openai", help="zero-shot templates written: openai, simple or a file")
    cb.set_defaults(func=run_export)
    declare_output(cb, "export", lambda args: args.output)  # the command runs under its lock


def export_clip_benchmark(release_spec: str, output: Path, templates: str = "openai") -> list[str]:
    """Write the CLIP_benchmark layout of ``release_spec`` to ``output``; returns the splits (configs) written."""
    from evaluation.release_reader import open_release
    from evaluation.zero_shot import class_names_for, load_template_set

    release = open_release(release_spec)
    template_set = load_template_set(templates)
    names, _ = class_names_for(release.label_names, (release.manifest.get("label_space") or {}).get("name"))
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(p.name != WORK_DIR for p in output.iterdir())):
        raise ValueError(f"export output {str(output)!r} exists and is not an empty directory; give a new folder")
    output.mkdir(parents=True, exist_ok=True)
    # the declared output lock (builder.cli) is held around the command
    bad = [n for n in names if "\n" in n or "\r" in n]
    if bad:
        raise ValueError(f"class name {bad[0]!r} holds a line break; classnames.txt is one name a line")
    (output / "classnames.txt").write_text("".join(f"{n}\n" for n in names), encoding="utf-8")
    (output / "zeroshot_classification_templates.txt").write_text(
        "".join(t.replace("{}", "{c}") + "\n" for t in template_set.templates), encoding="utf-8"
    )
    (output / "dataset_type.txt").write_text("classification\n", encoding="utf-8")
    for config in release.configs:
        folder = output / config
        folder.mkdir()
        shards = release.shards[config]
        for index, shard in enumerate(shards):
            target = folder / f"{index}.tar"
            try:
                os.link(shard, target)
            except OSError:
                shutil.copyfile(shard, target)
        (folder / "nshards.txt").write_text(f"{len(shards)}\n", encoding="utf-8")
    return list(release.configs)


def run_export(args: argparse.Namespace) -> int:
    configs = export_clip_benchmark(args.release, args.output, args.templates)
    name = Path(str(args.release).rstrip("/")).name.split("@")[0]
    print(f"wrote a CLIP_benchmark wds/ dataset to {args.output}: splits {', '.join(configs)}")  # noqa: T201
    print(  # noqa: T201
        f"next: clip_benchmark eval --dataset wds/{name} --dataset_root {args.output} --split {configs[-1]} "
        "--model ViT-B-32 --pretrained laion2b_s34b_b79k"
    )
    return 0
