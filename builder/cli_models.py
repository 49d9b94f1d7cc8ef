"""``lance-cf models list|download``: every model a build or a command will load, shown and fetched up front.

``TARGET`` is a preset or config file (``lance``, ``my.yaml``; ``--configs`` narrows it as in ``build``), or a
command with its own arguments (``eval --release R --model resnet50.a1_in1k --output E``): the models it declares
(``lance_pipeline.models.needs``). ``list`` prints, per model, its Hub id and pinned revision, the files its loader
reads and their total size, licence and gating (from the Hub, or kept from an earlier answer), who loads it and the
key that takes a local directory instead, and whether it is cached. ``download`` fetches exactly those files through
huggingface_hub (``HF_ENDPOINT``, ``HF_HOME``, ``HF_TOKEN``), resumably, under one progress bar; ``--local-dir DIR``
puts plain copies in ``DIR/ORG--NAME`` and writes ``DIR/<config>.yaml`` whose model keys point at them, for a GPU
machine without network.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path
from typing import Any

from builder.config import apply_overrides, load_config
from builder.model_check import BUILD_OFFLINE_WAYS, MODEL_COMMANDS, ModelsMissing, build_needs, keys_of, missing_line
from builder.release_format.lock import declare_output
from builder.validation import validate_build
from lance_pipeline.models.hub_cache import fetch_models, format_size, inspect_models, local_copy_dir

logger = logging.getLogger(__name__)

# Commands that declare the models they load (their parser's ``models`` default), usable as a TARGET.
COMMANDS = MODEL_COMMANDS


def register(subparsers) -> None:
    models = subparsers.add_parser(
        "models",
        help="list or download every model a build or command will load (for a machine without network too)",
        description="List or download every model a build (a preset or config) or a command (eval, discover, "
        "interfaces learn-tokens, perturber try, ...) will load, before it runs: Hub id, pinned revision, files and "
        "size, licence, gating, the key that takes a local directory instead, and whether it is cached.",
    )
    actions = models.add_subparsers(dest="models_action", metavar="ACTION", parser_class=type(models))
    actions.required = True
    for action, text in (
        ("list", "show the models, their files, sizes, licences and whether they are cached"),
        ("download", "fetch exactly the files they need (resumable; --local-dir: copies and a config)"),
    ):
        parser = actions.add_parser(action, help=text, description=text)
        parser.add_argument(
            "target",
            metavar="PRESET_OR_CONFIG | COMMAND",
            help="a preset or YAML config, or a command and its arguments (e.g. eval --release R --model M --output "
            "E; also discover, interfaces learn-tokens, perturber try)",
        )
        parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        _add_options(parser, action)
        parser.set_defaults(func=run_models)
        declare_output(parser, f"models {action}", _download_folder if action == "download" else None)


def _download_folder(args: argparse.Namespace) -> Path:
    """Where ``models download`` writes: ``--local-dir`` (also given after a config), else the Hugging Face cache."""
    local_dir = args.local_dir
    if local_dir is None and args.target not in COMMANDS and args.rest:
        extra = argparse.ArgumentParser(add_help=False)
        _add_options(extra, "download")
        local_dir = extra.parse_known_args(args.rest)[0].local_dir
    if local_dir is not None:
        return local_dir
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _add_options(parser: argparse.ArgumentParser, action: str) -> None:
    parser.add_argument("--configs", metavar="LIST", help="with a config: the configs to build (default: its own)")
    if action == "download":
        parser.add_argument(
            "--local-dir",
            type=Path,
            metavar="DIR",
            help="put plain copies in DIR/ORG--NAME and write DIR/<config>.yaml pointing at them (for a machine "
            "without network) instead of filling the Hugging Face cache",
        )
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _target_needs(args: argparse.Namespace) -> tuple[list[Any], str, Any]:
    """(needs, what they are for, the config or None) of the target."""
    rest = list(args.rest)
    if args.target in COMMANDS:
        try:
            command = args.root_parser.parse_args([args.target, *rest])
        except SystemExit as err:  # argparse already said what is wrong with the command's arguments
            raise ValueError(f"the arguments after {args.target!r} are not a valid {args.target} command") from err
        declare = getattr(command, "models", None)
        if declare is None:
            raise ValueError(f"lance-cf {' '.join([args.target, *rest[:1]])} loads no declared model")
        args.offline_ways = getattr(command, "offline_ways", None)  # what that command can use instead of the Hub
        return declare(command), f"lance-cf {shlex.join([args.target, *rest])}", None
    if rest:  # options given after the config: parse them as if before
        extra = argparse.ArgumentParser(prog=f"lance-cf models {args.models_action}", add_help=False)
        _add_options(extra, args.models_action)
        parsed, unknown = extra.parse_known_args(rest)
        if unknown:
            raise ValueError(f"unexpected argument(s) {' '.join(unknown)} after {args.target!r}")
        for name, value in vars(parsed).items():
            if value not in (None, False):
                setattr(args, name, value)

    config = load_config(args.target)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()] if args.configs else None
    config = apply_overrides(config, configs=configs)
    # The stages do not depend on the source: a config without one is checked with the demo's (and no source options).
    validated = validate_build(config if config.source else apply_overrides(config, source="demo", source_options={}))
    return build_needs(validated), f"{args.target} (configs {','.join(config.configs)})", config


def run_models(args: argparse.Namespace) -> int:
    needs, what, validated = _target_needs(args)
    if args.models_action == "list":
        states = inspect_models(needs, probe="all")
        _print_list(states, what, args)
        return 0
    return _download(args, needs, what, validated)


def _print_list(states: list[Any], what: str, args: argparse.Namespace) -> None:
    write = sys.stdout.write
    if not states:
        write(f"{what}: no model to load (demo components are built locally; nothing to download)\n")
        return
    hub = [s for s in states if s.need.repo_id is not None]
    known = [s.size for s in hub if s.size is not None]
    total = (format_size(sum(known)) + ("" if len(known) == len(hub) else " known")) if known else "size unknown"
    cached = sum(1 for s in states if s.cached)
    write(f"{what}: {len(states)} model(s), {total}, {cached} cached; each key also takes a local directory\n")
    unanswered = {s.problem for s in hub if s.problem and not s.exact}
    for state in states:
        need = state.need
        roles = "; ".join(dict.fromkeys(u.role for u in state.users if u.role)) or "model"
        if need.repo_id is None:
            status = "exists" if state.cached else "MISSING"
            write(f"  {need.local_path}: local directory, {status}\n      {roles} for {keys_of(state)}\n")
            continue
        revision = state.commit or need.revision
        facts = []
        if state.exact:
            facts.append(f"{format_size(state.size)} in {len(state.files)} file(s)")
            facts.append(f"licence {state.license or 'not stated'}")
            facts.append("not gated" if not state.gated else f"gated ({state.gated}): needs HF_TOKEN")
        else:
            facts.append("size, licence and gating unknown until the Hub answers")
        if state.cached:
            facts.append("cached")
        elif state.stand_in:
            facts.append(f"not cached (offline, the installed package {state.stand_in} is used)")
        else:
            facts.append("not cached" + (f": {state.problem}" if state.problem and state.exact else ""))
        write(f"  {need.repo_id}@{revision or 'main'}: {', '.join(facts)}\n")
        if need.builtin:
            write(f"      open_clip {need.builtin[0]} ({need.builtin[1]}): its weights, from the default branch\n")
        elif need.revision is None:
            write("      not pinned: the default branch\n")
        write(f"      {roles} for {keys_of(state)}\n")
        if state.exact:
            names = [f"{f} ({format_size(n)})" if n and n >= 10**7 else f for f, n in state.files.items()]
            write(f"      files: {', '.join(names)}\n")
        else:
            write(f"      files matching: {', '.join(need.files)}\n")
    for problem in sorted(unanswered):
        write(f"the Hub did not answer ({problem}); run this again where it does for sizes and licences\n")
    command = f"lance-cf models download {shlex.join([args.target, *args.rest])}" + (
        f" --configs {args.configs}" if args.configs and not args.rest else ""
    )
    if any(not s.cached and not s.stand_in for s in states):
        local = (
            "" if args.target in COMMANDS else "   (--local-dir DIR: copies and a config for a machine without network)"
        )
        write(f"next: {command}{local}\n")


def _download(args: argparse.Namespace, needs: list[Any], what: str, config: Any) -> int:
    local_dir = getattr(args, "local_dir", None)
    if local_dir is not None and config is None:
        raise ValueError("--local-dir writes a config whose model keys point at the copies: give a preset or config")
    hub_needs = [n for n in needs if n.repo_id is not None]
    states = inspect_models(hub_needs, probe="all" if local_dir is not None else "missing")
    missing = [s for s in states if s.problem and not s.need.optional and (local_dir is not None or not s.cached)]
    if missing:
        raise ModelsMissing(
            missing,
            then="nothing was downloaded: run this again where the Hub answers (a gated model: with HF_TOKEN)",
            offline_ways=getattr(args, "offline_ways", None) if args.target in COMMANDS else BUILD_OFFLINE_WAYS,
        )
    wanted = states if local_dir is not None else [s for s in states if not s.cached]
    if local_dir is not None:
        wanted = [s for s in wanted if not s.stand_in]
    total = sum(s.size or 0 for s in wanted)
    sys.stdout.write(f"{what}: {len(wanted)} model(s) to fetch, {format_size(total)} in all\n")
    for state in wanted:
        sys.stdout.write(f"  {missing_line(state)}\n")
    fetched = fetch_models(wanted, local_dir=local_dir, progress=not args.no_progress)
    sys.stdout.write(f"fetched {format_size(fetched)}; every model of {what} is here\n")
    if local_dir is not None:
        path = write_local_config(config, states, local_dir, args.target)
        sys.stdout.write(
            f"wrote {path}: its model keys point at the copies in {local_dir}. Copy {local_dir} to the machine "
            f"without network (at the same path, or edit the paths), then: lance-cf build {path} --source SPEC "
            "--output OUT\n"
        )
    return 0


def write_local_config(config: Any, states: list[Any], local_dir: Path, target: str) -> Path:
    """``DIR/<config>.yaml``: the config with each model key set to its local copy. A CLIP model's tag and revision
    are unset (the copy carries its own open_clip config); the other revisions stay, so the manifest names them."""
    import re

    import yaml

    copies = {}
    for state in states:
        for user in state.users:
            copies[user.key] = (str(local_copy_dir(local_dir, state).resolve()), user)
    data = config.to_dict()
    stages = {s["name"]: s for s in data["stages"]}
    for key, (path, need) in copies.items():
        match = re.fullmatch(r"stages\[([^\]]+)\]\.options\.(.+)", key)
        if match is None:
            continue
        options = stages[match.group(1)].setdefault("options", {})
        options[match.group(2)] = path
        if need.pretrained_key:  # open_clip: a directory takes neither tag nor revision
            for unset in (need.pretrained_key, need.revision_key):
                if unset:
                    options[unset.rsplit(".", 1)[1]] = None
    local_dir.mkdir(parents=True, exist_ok=True)
    out = local_dir / f"{Path(target).stem}.yaml"
    header = (
        f"# {target} with every model key pointing at a local copy made by `lance-cf models download "
        f"{target} --local-dir {local_dir}`;\n# the revisions stay as they were (a local directory ignores them), so "
        "the manifest still names them.\n"
    )
    out.write_text(header + yaml.safe_dump(data, sort_keys=False, width=120))
    return out
