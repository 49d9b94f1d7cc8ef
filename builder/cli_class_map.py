"""``lance-cf class-map``: a class map from a release's own label space to ImageNet-1k, for ``eval --class-map``.

A release built from class folders named by ImageNet synsets (``n02123045``) has ImageNet-1k labels and needs no map.
One built from folders named ``cat`` and ``dog`` has a label space of its own (label 0 is ``cat``), and an ImageNet
classifier can only be scored against it through a map: for each release label, the ImageNet-1k output that scores
it. This command writes that map in the text format ``eval`` reads (line ``i``: the ImageNet index of release label
``i``; ``#`` lines are comments): a class whose name is exactly one ImageNet class name (or synonym, "tabby cat")
gets its index; any other gets a line ``CHOOSE`` with the closest ImageNet classes in the comment above it, to be
replaced by hand (``eval`` refuses a map that still says ``CHOOSE``, naming the line).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from builder.imagenet import class_names
from builder.release_format.lock import declare_output, file_folder
from builder.release_format.manifest import load_manifest


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "class-map",
        help="write the map from a release's own classes to ImageNet-1k that eval --class-map needs",
        description="Write a class map (release label -> ImageNet-1k index) for `lance-cf eval --class-map`: exact "
        "name matches filled in, the others marked CHOOSE with the closest ImageNet classes as comments.",
    )
    parser.add_argument("release", type=Path, metavar="RELEASE", help="release directory (its manifest.json)")
    parser.add_argument(
        "--output",
        "-o",
        type=Path,
        help="file to write (default: RELEASE-name.classmap.txt here, or the next free RELEASE-name.classmap-N.txt)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite --output if it exists (your edits are lost)")
    parser.set_defaults(func=run_class_map)
    declare_output(parser, "class-map", lambda args: file_folder(args.output))


def _normalise(name: str) -> str:
    return " ".join(name.replace("_", " ").replace("-", " ").lower().split())


def imagenet_candidates(name: str, limit: int = 5) -> tuple[int | None, list[int]]:
    """(the index whose name or synonym is exactly ``name``, or None; the closest indices otherwise)."""
    names = class_names()
    wanted = _normalise(name)
    synonyms = {i: [_normalise(s) for s in n.split(",")] for i, n in enumerate(names)}
    exact = [i for i, options in synonyms.items() if wanted in options]
    if len(exact) == 1:
        return exact[0], []
    words = set(wanted.split())
    containing = [i for i, options in synonyms.items() if any(words & set(o.split()) for o in options)]
    flat = {o: i for i, options in synonyms.items() for o in options}
    close = [flat[o] for o in difflib.get_close_matches(wanted, list(flat), n=limit, cutoff=0.6)]
    return None, list(dict.fromkeys(exact + containing + close))[:limit]


def free_name(path: Path) -> Path:
    """``path`` if nothing is there, else the first free ``stem-N.suffix`` (N = 2, 3, ...): a map the user edited is
    never the default target."""
    candidate, number = path, 1
    while candidate.exists() or candidate.is_symlink():
        number += 1
        candidate = path.with_name(f"{path.stem}-{number}{path.suffix}")
    return candidate


def write_new_file(path: Path, text: str, *, force: bool, what: str) -> None:
    """Write ``text`` to ``path``, which must not exist unless ``force``: created exclusively (``open(..., "x")``),
    so a file that appears between the check and the write is not overwritten either."""
    if path.is_dir():
        raise ValueError(f"{what} {path} is a directory; give a file name")
    if force and (path.exists() or path.is_symlink()):
        path.unlink()
    try:
        with path.open("x", encoding="utf-8") as handle:
            handle.write(text)
    except FileExistsError:
        raise ValueError(
            f"{what} {path} exists (it may hold your edits); give another --output, or --force to overwrite it"
        ) from None


def run_class_map(args: argparse.Namespace) -> int:
    if not (args.release / "manifest.json").is_file():
        raise ValueError(f"{args.release} is not a release directory (no manifest.json); build it first")
    manifest = load_manifest(args.release)
    space = manifest.label_space.get("name")
    if space == "imagenet-1k":
        sys.stdout.write(f"{args.release}: its labels are ImageNet-1k indices already; eval needs no --class-map\n")
        return 0
    names = class_names()
    output = args.output or free_name(Path(f"{manifest.name}.classmap.txt"))
    lines = [
        f"# Class map for `lance-cf eval --release {args.release} --class-map {output}`.",
        "# Line i (comments aside) is the ImageNet-1k index that scores release label i. Replace every CHOOSE by the",
        "# index of the ImageNet class that best stands for that label (candidates in the comment above it).",
    ]
    to_choose = []
    for label, name in enumerate(manifest.label_names):
        index, candidates = imagenet_candidates(name)
        if index is not None:
            lines += [f"# {label} {name!r} = ImageNet {index} {names[index]!r}", str(index)]
            continue
        to_choose.append(name)
        listed = "; ".join(f"{i} {names[i]!r}" for i in candidates) or "none close by name"
        lines += [f"# {label} {name!r}: no ImageNet class of this name; closest: {listed}", "CHOOSE"]
    write_new_file(output, "\n".join(lines) + "\n", force=args.force, what="--output")
    total = len(manifest.label_names)
    write = sys.stdout.write
    write(f"wrote {output}: {total - len(to_choose)} of {total} classes matched an ImageNet-1k class by name\n")
    if to_choose:
        write(f"edit the {len(to_choose)} line(s) marked CHOOSE ({', '.join(to_choose[:5])}): the candidates are in "
              "the comment above each; eval refuses the map until then\n")  # fmt: skip
    write(f"next: lance-cf eval --release {args.release} --model resnet50.a1_in1k --class-map {output} --output ev\n")
    return 0
