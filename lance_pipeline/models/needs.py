"""What models a stage or a command will load, declared so that they can be listed, checked and fetched first.

A stage class declares the options that name a model in ``model_options`` (a tuple of :class:`ModelOption`); a
command declares a function of its parsed arguments that returns :class:`ModelNeed` s (``lance-cf`` commands set it
as the ``models`` default of their parser). Nothing is loaded to read a declaration: the option's value (a Hub id, a
local directory, ``demo:NAME``/``pkg:NAME``, or an open_clip name with its pretrained tag) and the declared file
patterns say which repository, revision and files the loader will read. ``lance_pipeline.models.hub_cache`` then checks
them against the Hugging Face cache, asks the Hub for what is missing (bounded, in seconds) and downloads exactly
those files; ``lance-cf models list|download`` shows and fetches them, and every build checks them before its first
stage loads.

File patterns are globs relative to the repository root in which ``*`` does not cross a ``/`` (``*.json`` is a file
at the root, ``tokenizer/*`` any file of that folder). ``required`` patterns must each match at least one cached file
when the exact file list is not known (offline, before anything was listed); the exact list, once the Hub gave it,
is kept beside the cache (``hub_cache``).
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import importlib.util
import os
import posixpath
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# What transformers' ``from_pretrained`` (model, tokenizer, processor, generation config) reads at the root of a repo:
# configs, safetensors weights (one file or shards with their index), tokenizer vocabularies and chat templates.
# Pickle weights and other frameworks' files are never needed (every loader passes ``use_safetensors=True``).
TRANSFORMERS_FILES = (
    "*.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "*.txt",
    "*.model",
    "*.jinja",
    "*.tiktoken",
)
TRANSFORMERS_REQUIRED = ("config.json", "model*.safetensors")
# sentence-transformers adds its module folders (``1_Pooling/config.json``).
SENTENCE_TRANSFORMERS_FILES = (*TRANSFORMERS_FILES, "[0-9]_*/*.json")
SENTENCE_TRANSFORMERS_REQUIRED = ("modules.json", "config.json", "model*.safetensors")
# Stable Diffusion's components as lance_pipeline.editing.sd_components loads them, one subfolder each.
SD_COMPONENT_FILES = (
    "unet/config.json",
    "unet/diffusion_pytorch_model.safetensors",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "tokenizer/*",
    "scheduler/scheduler_config.json",
)
# The whole pipeline (``StableDiffusionPipeline.from_pretrained`` without a safety checker).
SD_PIPELINE_FILES = ("model_index.json", *SD_COMPONENT_FILES, "feature_extractor/*.json")
# One diffusers model at the repo root (a ControlNet).
DIFFUSERS_MODEL_FILES = ("config.json", "diffusion_pytorch_model.safetensors")
PEFT_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# An open_clip model on the Hub (``hf-hub:ORG/NAME``): what open_clip's local-dir loader reads of its snapshot (the
# CLIP loader fetches exactly these); pickle checkpoints (*.bin, *.pth) are never fetched.
OPEN_CLIP_HUB_FILES = (
    "open_clip_config.json",
    "*.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
)
OPEN_CLIP_HUB_REQUIRED = ("open_clip_config.json", "*.safetensors")
# A built-in open_clip name with a pretrained tag: open_clip fetches the tag's safetensors file from its Hub repo;
# the config beside it (open_clip_config.json) lets a downloaded copy load as a local directory too.
OPEN_CLIP_WEIGHTS = "open_clip_model.safetensors"
# timm's pretrained weights (``timm.create_model(name, pretrained=True)`` reads only the safetensors file).
TIMM_FILES = ("model.safetensors",)
TIMM_REQUIRED = ("model.safetensors",)

LOCAL_PREFIXES = ("demo:", "pkg:")  # resolved to local directories by the builder (builder.models)


@dataclass(frozen=True)
class ModelOption:
    """A stage option that names a model: a Hub id (pinned by the ``revision`` option) or a local directory.

    Attributes:
        option: The option holding the model (``"model"``); this option takes a local directory instead.
        files: Patterns of the files the stage's loader reads from the repository.
        required: Patterns that must each match a cached file when the exact list is unknown (default: ``files``
            without wildcards).
        revision: The option holding the pinned revision, or None.
        pretrained: The option holding an open_clip pretrained tag: the model option then also takes a built-in
            open_clip name (``ViT-L-14``), whose weights open_clip fetches from the tag's Hub repo.
        cache_dir: The option holding a Hugging Face cache directory, if the stage has one.
        packaged: Hub ids the stage loads from an installed package instead while the Hub is offline:
            ``((hub id, module name), ...)``.
        role: What the model is, in a few words.
    """

    option: str
    files: tuple[str, ...] = TRANSFORMERS_FILES
    required: tuple[str, ...] | None = None
    revision: str | None = "revision"
    pretrained: str | None = None
    cache_dir: str | None = None
    packaged: tuple[tuple[str, str], ...] = ()
    role: str = ""


@dataclass(frozen=True)
class ModelNeed:
    """One model a stage or command will load.

    Attributes:
        repo_id: Hub model id, or None for a local directory (``local_path``).
        revision: The revision asked for (a pinned commit, a branch or tag; None: the default branch).
        files: Patterns of the files needed (see the module docstring).
        required: Patterns that must each match a cached file when the exact list is unknown.
        used_by: Who loads it (``"stage caption"``, ``"eval"``).
        key: The config key or command-line option that names it, and takes a local directory instead.
        revision_key: Where its revision is set, if anywhere.
        local_path: The local directory named instead of a Hub id.
        cache_dir: A Hugging Face cache directory of the stage's own (default: the hub's).
        packaged: A module that ships the same model, used instead while the Hub is offline.
        optional: The command runs without it (saying what it skipped).
        role: What the model is.
        builtin: ``(open_clip name, tag)`` when the key holds a built-in open_clip name, not a Hub id.
        pretrained_key: Where that tag is set (a local copy takes none).
    """

    repo_id: str | None
    revision: str | None
    files: tuple[str, ...]
    required: tuple[str, ...]
    used_by: str
    key: str
    revision_key: str | None = None
    local_path: str | None = None
    cache_dir: str | None = None
    packaged: str | None = None
    optional: bool = False
    role: str = ""
    builtin: tuple[str, str] | None = None
    pretrained_key: str | None = None

    @property
    def label(self) -> str:
        """``ORG/NAME@rev`` (12 characters of a commit), or the local directory."""
        if self.repo_id is None:
            return str(self.local_path)
        revision = self.revision or "main"
        return f"{self.repo_id}@{revision[:12] if is_commit(revision) else revision}"


def is_commit(revision: str | None) -> bool:
    return bool(revision) and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision)


def matches(path: str, pattern: str) -> bool:
    """``fnmatch`` in which ``*`` stays within one folder: the pattern and the path have as many ``/``."""
    return path.count("/") == pattern.count("/") and fnmatch.fnmatchcase(path, pattern)


def select_files(names: list[str] | dict[str, Any], patterns: tuple[str, ...]) -> list[str]:
    """The names that match any of ``patterns``, sorted."""
    return sorted(n for n in names if any(matches(n, p) for p in patterns))


def literal_patterns(patterns: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(p for p in patterns if not any(c in p for c in "*?["))


def reference_need(
    value: Any,
    *,
    files: tuple[str, ...],
    used_by: str,
    key: str,
    revision: str | None = None,
    revision_key: str | None = None,
    required: tuple[str, ...] | None = None,
    pretrained: str | None = None,
    pretrained_key: str | None = None,
    cache_dir: str | None = None,
    packaged: tuple[tuple[str, str], ...] = (),
    optional: bool = False,
    role: str = "",
) -> ModelNeed | None:
    """The need that a model reference ``value`` makes, or None when it needs nothing from the Hub or the disk.

    ``value`` is a Hub id, a local directory (also ``local-dir:DIR``), ``hf-hub:ORG/NAME`` (open_clip), a built-in
    open_clip name when ``pretrained`` (its tag) is given, or ``demo:``/``pkg:`` (made or shipped locally: nothing).
    """
    if not isinstance(value, str | os.PathLike) or not str(value).strip():
        return None
    value = os.fspath(value)
    required = literal_patterns(files) if required is None else required
    common = {
        "used_by": used_by,
        "key": key,
        "revision_key": revision_key,
        "cache_dir": cache_dir,
        "optional": optional,
        "role": role,
    }
    if value.startswith(LOCAL_PREFIXES):
        return None
    path = local_model_path(value)
    if path is not None:
        return ModelNeed(None, None, files, required, local_path=path, **common)
    if value.startswith("hf-hub:"):  # a local copy of it takes neither tag nor revision either (pretrained_key)
        return ModelNeed(value[len("hf-hub:") :], revision, OPEN_CLIP_HUB_FILES, OPEN_CLIP_HUB_REQUIRED,
                         pretrained_key=pretrained_key, **common)  # fmt: skip
    if pretrained is not None:  # a built-in open_clip name (OpenAI's "ViT-L/14" spelling too)
        if pretrained.endswith(".safetensors"):  # open_clip weights given as a local file
            return ModelNeed(None, None, (), (), local_path=pretrained, **common)
        hub = open_clip_weights(value, pretrained)
        if hub is None:
            return None  # not an open_clip name/tag with Hub weights; validation names the problem
        repo, weights = hub
        files = ("open_clip_config.json", weights)
        builtin = (value, pretrained)
        return ModelNeed(repo, None, files, (weights,), builtin=builtin, pretrained_key=pretrained_key, **common)
    stand_in = dict(packaged).get(value)
    return ModelNeed(value, revision, files, required, packaged=stand_in, **common)


def local_model_path(value: Any) -> str | None:
    """The local directory a model reference names (a path, an existing folder, or ``local-dir:DIR``), or None for a
    Hub id, an ``hf-hub:`` id, ``demo:``/``pkg:`` and anything that is not a string."""
    if not isinstance(value, str | os.PathLike):
        return None
    value = os.fspath(value)
    if not value.strip() or value.startswith((*LOCAL_PREFIXES, "hf-hub:")):
        return None
    if value.startswith("local-dir:") or os.path.isdir(os.path.expanduser(value)) or value.startswith(("/", ".", "~")):
        return value.removeprefix("local-dir:")
    return None


def local_model_inputs(cls: type, options: dict[str, Any]) -> dict[str, str]:
    """``{option: local path}`` for each model option of a stage (``model_options``) whose value names a local
    directory, and each open_clip ``pretrained`` option that names a weights file, as ``reference_need`` reads them."""
    found = {}
    for declared in getattr(cls, "model_options", ()):
        path = local_model_path(options.get(declared.option))
        if path is not None:
            found[declared.option] = path
        tag = options.get(declared.pretrained) if declared.pretrained else None
        if isinstance(tag, str) and tag.endswith(".safetensors"):  # open_clip weights given as a local file
            found[declared.pretrained] = tag
    return found


def needs_of(cls: type, options: Any, stage: str) -> list[ModelNeed]:
    """The models a stage of class ``cls`` with (typed, defaults filled) ``options`` will load, from its
    ``model_options`` declaration. ``options`` is a dataclass instance or a mapping; keys are reported as
    ``stages[STAGE].options.OPTION``."""

    def get(name: str | None) -> Any:
        if name is None:
            return None
        return options.get(name) if isinstance(options, dict) else getattr(options, name, None)

    needs = []
    for declared in getattr(cls, "model_options", ()):
        prefix = f"stages[{stage}].options."
        need = reference_need(
            get(declared.option),
            files=declared.files,
            required=declared.required,
            used_by=f"stage {stage}",
            key=prefix + declared.option,
            revision=get(declared.revision),
            revision_key=prefix + declared.revision if declared.revision else None,
            pretrained=get(declared.pretrained) if declared.pretrained else None,
            pretrained_key=prefix + declared.pretrained if declared.pretrained else None,
            cache_dir=get(declared.cache_dir),
            packaged=declared.packaged,
            role=declared.role,
        )
        if need is not None:
            needs.append(need)
    return needs


# -- open_clip's built-in pretrained tags, read without importing open_clip (and torch) ---------------------------------
def open_clip_weights(name: str, tag: str) -> tuple[str, str] | None:
    """``(Hub repo, safetensors file)`` from which open_clip fetches built-in ``name``'s weights for ``tag``, or None.

    open_clip keeps this table in ``open_clip/pretrained.py``; importing open_clip imports torch (seconds), so the
    table is read from the module's source. If the source cannot be read that way, open_clip itself is asked.
    """
    table = _open_clip_table()
    base = name.removesuffix("-quickgelu").replace("/", "-")
    if table is not None and base in table:
        hub = table[base].get(tag.lower().replace("-", "_"))
    else:
        try:
            import open_clip
        except ImportError:
            return None
        hub = (open_clip.get_pretrained_cfg(name, tag) or {}).get("hf_hub")
    if not hub:
        return None
    # open_clip: "ORG/NAME/" is the repo with its default file (open_clip_pytorch_model.bin, fetched as
    # open_clip_model.safetensors); "ORG/NAME/FILE.bin" names the file, fetched as FILE.safetensors.
    repo, filename = posixpath.split(hub)
    if not filename or filename == "open_clip_pytorch_model.bin":
        return repo, OPEN_CLIP_WEIGHTS
    return repo, filename.rsplit(".", 1)[0] + ".safetensors" if filename.endswith((".bin", ".pth")) else filename


@functools.cache
def _open_clip_table() -> dict[str, dict[str, str]] | None:
    """``{model name: {clean tag: hf_hub}}`` from open_clip's ``pretrained.py``, or None if it cannot be parsed."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or spec.origin is None:
        return None
    try:
        tree = ast.parse((Path(spec.origin).parent / "pretrained.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None
    tables: dict[str, dict[str, ast.expr]] = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        value = node.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict":
            entries = {kw.arg: kw.value for kw in value.keywords if kw.arg}
        elif isinstance(value, ast.Dict):
            entries = {k.value: v for k, v in zip(value.keys, value.values, strict=True) if isinstance(k, ast.Constant)}
        else:
            continue
        tables[node.targets[0].id] = entries
    if "_PRETRAINED" not in tables:
        return None
    result: dict[str, dict[str, str]] = {}
    for model, ref in tables["_PRETRAINED"].items():
        if not (isinstance(ref, ast.Name) and ref.id in tables):
            continue
        tags = {}
        for tag, call in tables[ref.id].items():
            if isinstance(call, ast.Call):
                for kw in call.keywords:
                    if kw.arg == "hf_hub" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                        tags[str(tag).lower().replace("-", "_")] = kw.value.value
        result[str(model)] = tags
    return result


def merge_needs(needs: list[ModelNeed]) -> list[tuple[ModelNeed, list[ModelNeed]]]:
    """Needs of the same repository, revision and cache, merged (files unioned), each with every need it covers, in
    first-use order. Local directories are kept apart, one entry per directory."""
    merged: dict[tuple, tuple[ModelNeed, list[ModelNeed]]] = {}
    for need in needs:
        ident = (need.repo_id, need.revision, need.cache_dir) if need.repo_id else (None, need.local_path, need.key)
        if ident not in merged:
            merged[ident] = (need, [need])
            continue
        first, users = merged[ident]
        files = tuple(dict.fromkeys(first.files + need.files))
        required = tuple(dict.fromkeys(first.required + need.required))
        merged[ident] = (replace(first, files=files, required=required, optional=first.optional and need.optional),
                         [*users, need])  # fmt: skip
    return list(merged.values())


def clip_option(role: str = "CLIP for the quality gates") -> ModelOption:
    """The CLIP scorer's options as the image stages and filters name them (``clip_model``, ``clip_pretrained``,
    ``clip_revision``, ``cache_dir``)."""
    return ModelOption(
        "clip_model",
        OPEN_CLIP_HUB_FILES,
        OPEN_CLIP_HUB_REQUIRED,
        revision="clip_revision",
        pretrained="clip_pretrained",
        cache_dir="cache_dir",
        role=role,
    )


# -- what commands declare (``lance-cf`` parsers set a function of the parsed arguments as their ``models`` default) --
def clip_need(
    model: str | None, pretrained: str | None, *, used_by: str, key: str, revision: str | None = None,
    optional: bool = False, role: str = "CLIP",
) -> ModelNeed | None:  # fmt: skip
    """A CLIP model named on a command line (a built-in open_clip name with its tag, ``hf-hub:`` id or directory)."""
    pretrained = None if pretrained is None or str(pretrained).lower() == "none" else pretrained
    is_name = model is not None and not str(model).startswith(("hf-hub:", "local-dir:", "demo:", "pkg:", "/", ".", "~"))
    return reference_need(
        model, files=OPEN_CLIP_HUB_FILES, required=OPEN_CLIP_HUB_REQUIRED, used_by=used_by, key=key,
        revision=revision, pretrained=pretrained if is_name and not os.path.isdir(str(model)) else None,
        optional=optional, role=role,
    )  # fmt: skip


def timm_need(name: str, *, used_by: str, key: str) -> ModelNeed | None:
    """The pretrained weights ``timm.create_model(name, pretrained=True)`` fetches from the Hub (None when timm takes
    them from elsewhere)."""
    if name.startswith("hf-hub:"):  # a model of timm's format on the Hub: its config and weights
        repo, _, revision = name[len("hf-hub:") :].partition("@")
        files = ("config.json", "model.safetensors")
        return ModelNeed(repo, revision or None, files, files, used_by, key, role=f"classifier {name}")
    import timm

    cfg = timm.models.get_pretrained_cfg(name)
    hub = getattr(cfg, "hf_hub_id", None) if cfg is not None else None
    if not hub:
        return None
    repo, _, revision = hub.partition("@")
    return ModelNeed(repo, revision or None, TIMM_FILES, TIMM_REQUIRED, used_by, key, role=f"classifier {name}")
