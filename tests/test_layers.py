"""The rooms of docs/architecture.md ("Rooms and what each may import"), checked on every import statement of every
module, including the lazy ones inside functions (a lazy import is still a dependency): each room imports only the
rooms its row allows, the rooms' import graph has no cycle, no module imports itself through others (the graph of
every module of every package), the doc's table is the test's, and ``import builder`` / ``lance-cf --help`` load no
model library."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("builder", "lance_pipeline", "evaluation", "dataset_cards")

# Room -> the other rooms it may import. A room is a top-level package's own modules ("builder": builder/*.py, its
# core) or one of its sub-packages ("builder.interfaces"). Rows are listed so that each imports only rows above it.
ALLOWED: dict[str, set[str]] = {
    "lance_pipeline.readers": set(),  # the one reader of structured input: the lowest room, every other may import it
    "lance_pipeline.models": set(),  # declared models and their files, the Hub cache, shared loads, the device rule
    # the stage contract, registry, option types, edit types, release kinds, how deviations are declared
    "lance_pipeline": {"lance_pipeline.models"},
    "builder.release_format": {
        "lance_pipeline"
    },  # a release's kind (its papers, its Hub metadata) from its declaration
    "lance_pipeline.text": {"lance_pipeline", "lance_pipeline.models"},
    "lance_pipeline.clip": {"lance_pipeline", "lance_pipeline.models"},
    "lance_pipeline.editing": {"lance_pipeline", "lance_pipeline.models", "lance_pipeline.clip"},
    "lance_pipeline.interfaces": {
        "lance_pipeline",
        "lance_pipeline.models",
        "lance_pipeline.clip",
        "lance_pipeline.editing",
    },
    "lance_pipeline.dillema": {
        "lance_pipeline",
        "lance_pipeline.models",
        "lance_pipeline.text",
        "lance_pipeline.clip",
        "lance_pipeline.editing",
    },
    "lance_pipeline.instruct": {
        "lance_pipeline",
        "lance_pipeline.models",
        "lance_pipeline.clip",
        "lance_pipeline.editing",
    },
    "lance_pipeline.discovery": {
        "lance_pipeline",
        "lance_pipeline.models",
        "lance_pipeline.clip",
        "lance_pipeline.text",
    },
    "lance_pipeline.perturber": {"lance_pipeline", "lance_pipeline.models", "lance_pipeline.text"},
    "lance_pipeline.screening": {
        "lance_pipeline",
        "lance_pipeline.models",
        "lance_pipeline.text",
        "lance_pipeline.editing",
    },
    "lance_pipeline.tiny": {  # tiny random-weight components of every method room (tests and offline demos)
        "lance_pipeline",
        "lance_pipeline.models",
        "lance_pipeline.text",
        "lance_pipeline.clip",
        "lance_pipeline.editing",
        "lance_pipeline.interfaces",
        "lance_pipeline.dillema",
        "lance_pipeline.instruct",
        "lance_pipeline.discovery",
        "lance_pipeline.perturber",
    },
    "evaluation": {"builder.release_format", "lance_pipeline", "lance_pipeline.models", "lance_pipeline.clip"},
    "evaluation.interfaces": {"builder.release_format", "lance_pipeline", "lance_pipeline.models", "evaluation"},
    "dataset_cards": {
        "builder.release_format",
        "lance_pipeline",
        "lance_pipeline.models",
        "evaluation",
        "evaluation.interfaces",
    },
    "builder": {"builder.release_format", "lance_pipeline", "lance_pipeline.models", "dataset_cards"},
    "builder.interfaces": {
        "builder",
        "builder.release_format",
        "lance_pipeline",
        "lance_pipeline.models",
        "lance_pipeline.clip",
        "lance_pipeline.interfaces",
        "lance_pipeline.tiny",
        "evaluation",
        "evaluation.interfaces",
        "dataset_cards",
    },
    "builder.discovery": {
        "builder",
        "builder.release_format",
        "lance_pipeline",
        "lance_pipeline.models",
        "lance_pipeline.clip",
        "lance_pipeline.text",
        "lance_pipeline.interfaces",
        "lance_pipeline.discovery",
        "lance_pipeline.tiny",
        "evaluation",
        "dataset_cards",
    },
    "builder.perturber": {
        "builder",
        "builder.release_format",
        "lance_pipeline",
        "lance_pipeline.models",
        "lance_pipeline.text",
        "lance_pipeline.perturber",
        "lance_pipeline.tiny",
    },
    "builder.review": {"builder", "builder.release_format"},
}
# The reader of YAML, JSON and JSON lines (bounded, strict) is below every room: each may import it.
for _room in ALLOWED:
    if _room != "lance_pipeline.readers":
        ALLOWED[_room].add("lance_pipeline.readers")
# Imports the table forbids that a change under way removes (evaluation asking the release kinds instead of
# importing its interfaces room): listed so that the test below fails once they are gone and this entry must go.
PENDING: set[tuple[str, str]] = set()  # (evaluation -> evaluation.interfaces went: evaluation asks the release kinds)
# What `import builder` and `lance-cf --help` must not load.
MODEL_LIBRARIES = ("torch", "torchvision", "diffusers", "transformers", "open_clip", "timm", "datasets", "peft",
                   "accelerate", "sentence_transformers", "ray")  # fmt: skip


def room_of(module: str) -> str | None:
    """The room of a dotted module name (``builder.interfaces.cli`` -> ``builder.interfaces``), None if third-party."""
    parts = module.split(".")
    if parts[0] not in FIRST_PARTY:
        return None
    if len(parts) > 1 and (REPO / parts[0] / parts[1] / "__init__.py").is_file():
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def module_name(path: Path) -> str:
    """The dotted name of a first-party file (a package's ``__init__.py`` is the package)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def first_party_imports(path: Path, module: str | None = None) -> list[str]:
    """Every first-party module a file imports, at the top or inside functions, relative imports resolved against
    ``module`` (the file's own dotted name by default); ``from builder import x`` counts as ``builder.x``
    (:func:`imported_module` finds which module that is)."""
    found = []
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = (module or module_name(path)).split(".")
                package = package if path.name == "__init__.py" else package[:-1]
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            found += [f"{base}.{alias.name}" for alias in node.names]
    return [m for m in found if room_of(m) is not None]


def imported_module(name: str, modules: set[str]) -> str:
    """The first-party module an imported name loads: ``builder.release_format.load_yaml`` is the package
    ``builder.release_format`` (a name in its ``__init__``), ``builder.release_format.spec`` the module."""
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name


@functools.cache
def module_graph() -> dict[str, set[str]]:
    """Module -> the first-party modules it imports (lazy imports included), for every module of every package."""
    files = {module_name(path): path for top in FIRST_PARTY for path in sorted((REPO / top).rglob("*.py"))}
    graph = {}
    for module, path in files.items():
        graph[module] = {imported_module(name, set(files)) for name in first_party_imports(path)} - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _modules() -> list[tuple[Path, str]]:
    return [
        (path, room_of(".".join(path.relative_to(REPO).with_suffix("").parts)))
        for top in FIRST_PARTY
        for path in sorted((REPO / top).rglob("*.py"))
    ]


def _edges() -> dict[tuple[str, str], list[str]]:
    """(room, room it imports) -> where (file: module), for every import between two rooms."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path, room in _modules():
        for module in first_party_imports(path):
            target = room_of(module)
            if target != room:
                edges.setdefault((room, target), []).append(f"{path.relative_to(REPO)}: {module}")
    return edges


def test_every_room_is_in_the_table():
    rooms = {room for _, room in _modules()}
    assert len(rooms) >= 17
    assert rooms == set(ALLOWED), f"rooms without a row: {sorted(rooms - set(ALLOWED))}"


@pytest.mark.slow
def test_every_module_imports_only_the_rooms_its_row_allows():
    violations = [
        f"{where} ({room} may import {sorted(ALLOWED[room]) or 'no other room'})"
        for (room, target), places in _edges().items()
        if target not in ALLOWED[room] and (room, target) not in PENDING
        for where in places
    ]
    assert not violations, "\n".join(violations)


@pytest.mark.skipif(not PENDING, reason="no import is pending removal")
def test_pending_imports_are_gone():
    assert not [pair for pair in PENDING if pair in _edges()]


def test_the_table_and_so_the_import_graph_has_no_cycle():
    """Every row names only rows above it: the allowed graph is acyclic, so the actual one (a subgraph) is too."""
    seen: set[str] = set()
    for room, allowed in ALLOWED.items():
        assert allowed <= seen, f"{room} may import {sorted(allowed - seen)}, listed below it"
        seen.add(room)


def test_no_module_imports_itself_through_others():
    """The rooms' graph has no cycle (above); neither has the graph of modules inside and across rooms
    (``metadata`` -> ``spec`` -> ``metadata`` would be one, even with the second import inside a function)."""
    graph = module_graph()
    assert len(graph) >= 150
    found = cycles(graph)
    described = [" -> ".join(c) + f" ({', '.join(f'{a} imports {b}' for a in c for b in sorted(graph[a]) if b in c)})"
                 for c in found]  # fmt: skip
    assert not found, "import cycles:\n" + "\n".join(described)


def test_the_cycle_check_finds_a_cycle_through_a_lazy_or_relative_import(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    module = tmp_path / "m.py"
    module.write_text("from . import spec\nfrom .layout import KEY_PATTERN\ndef f():\n    from .. import cli\n")
    assert first_party_imports(module, "builder.release_format.m") == [
        "builder.release_format.spec",
        "builder.release_format.layout.KEY_PATTERN",
        "builder.cli",
    ]
    modules = set(module_graph())
    assert module_name(REPO / "builder" / "release_format" / "__init__.py") == "builder.release_format"
    assert imported_module("builder.release_format.layout.KEY_PATTERN", modules) == "builder.release_format.layout"
    assert imported_module("builder.release_format.load_yaml", modules) == "builder.release_format"


def doc_table() -> dict[str, set[str]]:
    """docs/architecture.md's table "Rooms and what each may import": room -> the rooms its row may import."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Rooms and what each may import\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    table = {}
    for row in rows:
        room_cell, _, may_cell = [cell.strip() for cell in row.strip("|").split(" | ")]
        room = re.fullmatch(r"`([a-z_.]+)`( \(core\))?", room_cell)
        assert room, f"docs/architecture.md: a row's room is one `name`: {room_cell!r}"
        table[room.group(1)] = set() if may_cell == "no other room" else set(re.findall(r"`([a-z_.]+)`", may_cell))
    # The reader's row says every room below it may import it; the other rows do not repeat it.
    for room in table:
        if room != "lance_pipeline.readers":
            table[room].add("lance_pipeline.readers")
    return table


def test_the_docs_layer_table_is_the_tests():
    """The table a reader follows is the one checked: same rooms, same order, same rows."""
    table = doc_table()
    assert list(table) == list(ALLOWED), "docs/architecture.md lists the rooms in another order or set than ALLOWED"
    differ = {room: (sorted(table[room]), sorted(ALLOWED[room])) for room in ALLOWED if table[room] != ALLOWED[room]}
    assert not differ, f"rows that differ (docs, test): {differ}"


def test_the_check_sees_lazy_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from builder.registry import EDITORS\n    import evaluation.metrics\n")
    assert first_party_imports(module) == ["builder.registry.EDITORS", "evaluation.metrics"]
    assert room_of("builder.registry") == "builder" and "builder" not in ALLOWED["lance_pipeline"]
    assert room_of("builder.release_format.shards") == "builder.release_format"
    assert room_of("lance_pipeline.editing.stages") == "lance_pipeline.editing"


def test_import_builder_and_the_cli_parser_load_no_model_library():
    """What ``lance-cf --help`` runs: import the CLI and build every subcommand's parser, in a fresh interpreter."""
    code = (
        "import sys, builder, builder.cli; builder.cli.build_parser(); "
        f"print(sorted(m for m in {MODEL_LIBRARIES!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# What only stages load (the build itself needs torch: devices, threads, the determinism record).
STAGE_LIBRARIES = tuple(m for m in MODEL_LIBRARIES if m not in ("torch", "torchvision"))


@pytest.mark.slow
def test_a_build_of_stages_that_load_no_model_imports_no_model_library(tmp_path):
    """Stages that declare no model (the test suite's fake stages; an ``original`` release has none at all) never
    meet a library's loading bars, so the build does not import transformers or diffusers to silence them: seconds
    per build process."""
    import os

    from builder_helpers import ALL_CONFIGS, FAKE_STAGES, make_imagefolder, write_config

    source = make_imagefolder(tmp_path / "src", ["a", "b"], per_class=1)
    config = write_config(tmp_path / "c.yaml", f"imagefolder:{source}", stages=FAKE_STAGES, configs=ALL_CONFIGS)
    code = (
        "import sys; from builder.config import load_config; from builder.engine import build; "
        f"build(load_config({str(config)!r}), {str(tmp_path / 'out')!r}, progress=False); "
        f"print(sorted(m for m in {STAGE_LIBRARIES!r} if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "LANCE_CF_ALLOW_CODE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_a_code_stage_type_in_a_moved_module_names_its_new_place(tmp_path, capsys):
    """Configs written before each system got its folder: a ``module:attr`` type at the old place is one line."""
    import yaml

    from builder.cli import main

    config = tmp_path / "old.yaml"
    stage = {"name": "caption", "type": "lance_pipeline.captioning:CaptionStage", "configs": ["counterfactual"]}
    config.write_text(
        yaml.safe_dump({"name": "old", "source": "demo", "configs": ["counterfactual"], "stages": [stage]})
    )
    assert main(["validate", str(config), "--allow-code"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert (
        "module lance_pipeline.captioning moved to lance_pipeline.text.captioning; "
        "write lance_pipeline.text.captioning:CaptionStage" in err
    )
