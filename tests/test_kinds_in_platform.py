"""Platform code reaches a release kind only through its declaration (``lance_pipeline.release_kinds``) and names no
kind: no string in ``builder``, ``evaluation`` or ``dataset_cards`` is a kind's name, a source kind or stage type that
recognises it, an editor it declares, a results section of its own, or a stage type or source it registers.

Excluded, as the kinds' own rooms: each mode's sub-packages of the platform (``builder/interfaces/``,
``builder/discovery/``, ``builder/perturber/``, ``evaluation/interfaces/``) and every platform module a kind's
declaration names as a target (its card paragraph and sections in ``dataset_cards``, its results and tables in
``evaluation``): those modules are the kind's code in that layer. Docstrings and comments may name kinds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lance_pipeline.release_kinds import DEFAULT_KIND, list_kinds

REPO = Path(__file__).resolve().parents[1]
PLATFORM = ("builder", "evaluation", "dataset_cards")
MODE_ROOMS = ("builder/interfaces", "builder/discovery", "builder/perturber", "evaluation/interfaces")


def kind_words() -> set[str]:
    """Every word that names a kind or something only a kind has."""
    words: set[str] = set()
    for kind in list_kinds():
        if kind.name != DEFAULT_KIND:  # "lance" is also the tool's name and the Hub tag every release carries
            words.add(kind.name)
        words |= set(kind.source_kinds) | set(kind.stage_types) | set(kind.editors) | set(kind.results_sections)
        words |= set(getattr(kind, "stages", {})) | set(getattr(kind, "sources", {}))
    return words


def kind_modules() -> set[str]:
    """Platform modules a kind's declaration names as a target (``module:attr``): the kind's code in that layer."""
    targets = []
    for kind in list_kinds():
        targets += [kind.card_intro, kind.card_section, kind.card_failure_modes, kind.leaderboard, kind.report_section]
        targets += [kind.summary_lines, *kind.results_sections.values()]
    return {t.split(":")[0] for t in targets if t}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                ids.add(id(body[0].value))
    return ids


def platform_files() -> list[Path]:
    skip = kind_modules()
    files = []
    for package in PLATFORM:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            module = rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
            if rel.startswith(tuple(f"{room}/" for room in MODE_ROOMS)) or module in skip:
                continue
            files.append(path)
    return files


def kind_names_in(path: Path, words: set[str]) -> list[str]:
    """``path:line: 'word'`` for each string constant of the file (docstrings aside) that is a kind word."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in words:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    return found


@pytest.mark.slow
def test_platform_code_names_no_release_kind():
    words = kind_words()
    assert {"interfaces", "discovery", "controlnet", "shift_generation", "generate"} <= words  # the scan sees them
    found = [hit for path in platform_files() for hit in kind_names_in(path, words)]
    assert not found, "platform code names a release kind; reach it through its declaration:\n" + "\n".join(found)


def test_the_scan_finds_a_kind_named_in_platform_code(tmp_path):
    """The scan is not blind: a switch on a kind in a platform module is found, its docstring is not."""
    module = tmp_path / "switch.py"
    module.write_text('"""Mentions interfaces in prose."""\n\n\ndef f(kind):\n    return kind == "interfaces"\n')
    hits = kind_names_in_tmp(module, kind_words())
    assert hits == ["switch.py:5: 'interfaces'"]


def kind_names_in_tmp(path: Path, words: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = _docstrings(tree)
    return [
        f"{path.name}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
        and node.value in words
    ]  # fmt: skip
