"""The layers of docs/architecture.md ("Layers and what each may import"), checked on every import statement of every
module, including the lazy ones inside functions (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("builder", "lance_pipeline", "evaluation", "dataset_cards")

# Layer -> the first-party layers it may import (itself always). The graph is acyclic: each layer imports only
# layers listed before it.
ALLOWED = {
    "builder.release_format": set(),
    "lance_pipeline": set(),
    "evaluation": {"builder.release_format", "lance_pipeline"},
    "dataset_cards": {"builder.release_format", "lance_pipeline", "evaluation"},
    "builder": {"builder.release_format", "lance_pipeline", "evaluation", "dataset_cards"},
}


def layer_of(module: str) -> str | None:
    if module == "builder.release_format" or module.startswith("builder.release_format."):
        return "builder.release_format"
    top = module.split(".")[0]
    return top if top in FIRST_PARTY else None


def first_party_imports(path: Path) -> list[str]:
    """Every first-party module a file imports (``from builder import x`` counts as ``builder.x``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in FIRST_PARTY:
                found += [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                found.append(node.module)
    return [m for m in found if layer_of(m) is not None]


def test_every_module_imports_only_the_layers_below_it():
    violations = []
    checked = 0
    for layer, allowed in ALLOWED.items():
        folder = REPO / layer.replace(".", "/")
        for path in sorted(folder.rglob("*.py")):
            if layer_of(".".join(path.relative_to(REPO).with_suffix("").parts)) != layer:
                continue  # a nested layer (builder.release_format inside builder) is checked as its own
            checked += 1
            for module in first_party_imports(path):
                target = layer_of(module)
                if target != layer and target not in allowed:
                    violations.append(f"{path.relative_to(REPO)} imports {module} ({layer} may import {allowed})")
    assert checked > 80  # every package was found
    assert not violations, "\n".join(violations)


def test_the_check_sees_lazy_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from builder.registry import EDITORS\n    import evaluation.metrics\n")
    assert first_party_imports(module) == ["builder.registry", "evaluation.metrics"]
    assert layer_of("builder.registry") == "builder" and "builder" not in ALLOWED["lance_pipeline"]
    assert layer_of("builder.release_format.shards") == "builder.release_format"


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
