"""The test tiers as the README, the Makefile and CI use them: CI runs the README's test command, and the tiers CI
runs select every test exactly once (a marker left out of both, or a tier run twice, fails here)."""

from __future__ import annotations

import functools
import itertools
import re

from builder_helpers import REPO, readme_blocks


def readme_test_command() -> str:
    """The test command of the README's first block under "Set up and run"."""
    (command,) = [c for c in readme_blocks("Set up and run")[0] if c.startswith("make test")]
    return command


def ci_make_targets() -> list[str]:
    """The make targets `.ci/run` runs, in order."""
    lines = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    return [line.split()[1] for line in lines if line.startswith("make ")]


def pytest_marker_expression(target: str) -> str:
    """The ``-m`` expression of the pytest command in a Makefile target's recipe ("" when it selects every test)."""
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe, f"no target {target} in the Makefile"
    (command,) = [line for line in recipe.group(1).splitlines() if " -m pytest " in line]
    found = re.search(r' -m ("[^"]*"|\S+)', command.split(" -m pytest ", 1)[1])
    return found.group(1).strip('"') if found else ""


@functools.cache
def declared_markers() -> tuple[str, ...]:
    """The markers pyproject.toml declares (read when a test first asks: tomllib needs Python 3.11)."""
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    return tuple(line.split(":")[0] for line in declared["markers"])


OPERATORS = ("and", "or", "not", "(", ")")


def marker_sets() -> list[set[str]]:
    """Every set of the declared markers a test can carry, the empty one included."""
    return [set(c) for n in range(len(declared_markers()) + 1) for c in itertools.combinations(declared_markers(), n)]


def selects(expression: str, present: set[str]) -> bool:
    """Whether pytest's ``-m expression`` selects a test with the markers ``present`` (and, or, not, names)."""
    if not expression:
        return True
    words = re.findall(r"\w+|[()]", expression)
    assert all(w in OPERATORS or w in declared_markers() for w in words), expression
    python = " ".join(w if w in OPERATORS else str(w in present) for w in words)
    return eval(python, {"__builtins__": {}})  # only True, False, and, or, not and brackets, checked above


def test_ci_runs_the_readmes_test_command_first():
    command = readme_test_command()
    assert command == "make test"
    tiers = [t for t in ci_make_targets() if t.startswith("test")]
    assert tiers[0] == command.split()[1], tiers


def test_the_tiers_ci_runs_select_every_test_exactly_once():
    tiers = [t for t in ci_make_targets() if t.startswith("test")]
    expressions = {t: pytest_marker_expression(t) for t in tiers}
    for present in marker_sets():
        chosen = [t for t, e in expressions.items() if selects(e, present)]
        assert len(chosen) == 1, f"a test marked {sorted(present) or 'with no marker'} runs in {chosen} ({expressions})"


def test_the_fast_tier_is_part_of_make_test():
    fast, full = pytest_marker_expression("test-fast"), pytest_marker_expression("test")
    for present in marker_sets():
        assert not selects(fast, present) or selects(full, present), present


def test_selects_evaluates_and_or_not_over_a_tests_markers():
    assert selects("not e2e", {"slow"}) and not selects("not e2e", {"slow", "e2e"})
    assert selects("not slow and not e2e", set()) and not selects("not slow and not e2e", {"slow"})
    assert selects("e2e", {"e2e"}) and not selects("e2e", set()) and selects("", {"e2e"})
