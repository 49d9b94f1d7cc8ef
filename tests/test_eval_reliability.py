"""Attacks on ``lance-cf eval`` outputs and ``lance-cf publish-results`` numbers, through the CLI.

Eval outputs: each release's results live in ``OUTPUT/<release>/`` and are never replaced by another release's
without ``--force``; one eval at a time holds an ``--output`` (the release format's directory lock, as builds do), and
two real eval processes started together into one ``--output`` never both succeed over lost results. Published
numbers: NaN, out-of-range accuracies, impossible counts and huge label names are refused before anything is
uploaded, and what is written is strict JSON.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from builder_helpers import lock_held_by_another_process
from publish_fixture import make_release, make_results
from release_fixture import write_release

from builder.cli import main
from evaluation.results import validate_results

pytestmark = pytest.mark.e2e  # real eval processes, and the lance-cf CLI end to end

ROOT = Path(__file__).resolve().parents[1]
EVAL = ["--model", "test_vit", "--no-pretrained", "--workers", "0", "--bootstrap", "0", "--no-insights", "--no-report"]


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    base = tmp_path_factory.mktemp("releases")
    small = {"originals_per_class": 1, "edits_per_original": 1, "labels": (1, 207)}
    return {
        "a": write_release(base / "a", name="rel-a", **small),
        "b": write_release(base / "b", name="rel-b", **small),
        "a-rebuilt": write_release(base / "a2", name="rel-a", seed=1, **small),  # same name, other images
    }


def _results(out: Path, release: str) -> Path:
    return out / release / "test_vit__random" / "results.json"


def test_another_release_is_added_beside_and_never_replaces_without_force(releases, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["eval", "--release", str(releases["a"]), "--output", str(out), *EVAL]) == 0
    first = _results(out, "rel-a").read_bytes()
    # another release into the same --output: its own folder, the first one's results untouched
    assert main(["eval", "--release", str(releases["b"]), "--output", str(out), *EVAL]) == 0
    assert "done: 1 evaluated" in capsys.readouterr().out
    assert _results(out, "rel-a").read_bytes() == first and _results(out, "rel-b").is_file()
    # the same name, other data (a rebuild): refused in one line naming both, nothing replaced
    rebuilt = ["eval", "--release", str(releases["a-rebuilt"]), "--output", str(out), *EVAL]
    assert main(rebuilt) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds the results of release rel-a 1.0.0" in err[0] and "--force" in err[0], err
    assert _results(out, "rel-a").read_bytes() == first
    # --force replaces them, and only them
    assert main([*rebuilt, "--force"]) == 0
    replaced = json.loads(_results(out, "rel-a").read_text())
    assert replaced["release"]["manifest_sha256"] != json.loads(first)["release"]["manifest_sha256"]
    assert _results(out, "rel-b").is_file()
    marker = json.loads((out / "rel-a" / "release.json").read_text())
    assert marker["manifest_sha256"] == replaced["release"]["manifest_sha256"] and marker["kind"] == "lance"


def test_eval_is_refused_while_another_process_holds_the_output(releases, tmp_path, capsys):
    """A real second process holds the --output as an eval does: refused at once with its pid, nothing written."""
    out = tmp_path / "out"
    out.mkdir()
    with lock_held_by_another_process(out, "eval") as pid:
        capsys.readouterr()
        assert main(["eval", "--release", str(releases["a"]), "--output", str(out), *EVAL]) == 2
        err = capsys.readouterr().err
        assert f"in use by lance-cf pid {pid} (eval)" in err and len(err.strip().splitlines()) == 1
        assert not list(out.rglob("*.json"))
    assert main(["eval", "--release", str(releases["a"]), "--output", str(out), *EVAL]) == 0  # free again


def test_two_eval_processes_into_one_output_never_both_succeed_over_lost_results(releases, tmp_path):
    """Two real `lance-cf eval` processes started together into one --output (no timing assumed): each either
    finishes with its results on disk or is refused naming the other's pid; re-running a refused one completes."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

    def start(release: str):
        argv = [sys.executable, "-m", "builder.cli", "eval", "--release", str(releases[release]), "--output", str(out)]
        return subprocess.Popen([*argv, *EVAL], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    procs = {"rel-a": start("a"), "rel-b": start("b")}
    outcomes = {name: (p.wait(), p.stderr.read().decode()) for name, p in procs.items()}
    assert any(code == 0 for code, _ in outcomes.values()), outcomes
    for name, (code, err) in outcomes.items():
        if code == 0:
            validate_results(json.loads(_results(out, name).read_text()))
        else:
            other = next(p.pid for n, p in procs.items() if n != name)
            # The pid comes from the kernel's lock table; the command from the holder's note, which the holder
            # writes just after it takes the lock: a refusal in between names the pid alone.
            assert code == 2 and re.search(rf"in use by lance-cf pid {other}( \(eval\))?;", err), err
            assert main(["eval", "--release", str(releases[name[4:]]), "--output", str(out), *EVAL]) == 0
    for name in procs:
        validate_results(json.loads(_results(out, name).read_text()))


# ------------------------------------------------------------------------------------------ publish-results numbers
@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return make_release(tmp_path_factory.mktemp("published"))[1]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda r: r["metrics"]["counterfactual"].update(acc1=math.nan), "'metrics.counterfactual.acc1' is nan"),
        (lambda r: r["metrics"]["original"].update(acc1=-3.0), "'metrics.original.acc1' must be a percentage"),
        (lambda r: r["metrics"]["original"].update(acc5=107.5), "'metrics.original.acc5' must be a percentage"),
        (lambda r: r["metrics"]["original"].update(n=12, acc1=7.5), "is not a whole number of correct samples"),
        (lambda r: r["metrics"]["original"].update(n=-5), "'metrics.original.n' must be a count"),
        (lambda r: r["metrics"]["original"].update(n=10**12), "'metrics.original.n' must be a count"),
        (lambda r: r["sensitivity"]["overall"].update(flip_rate=math.inf), "flip_rate' is inf"),
        (lambda r: r["sensitivity"]["overall"].update(paired_delta_acc1=-130.0), "difference in [-100, 100] points"),
        (lambda r: r["sensitivity"]["overall"].update(paired_delta_acc1_ci=[-5.0, 250.0]), "paired_delta_acc1_ci"),
        (
            lambda r: r["sensitivity"].update(by_class={"1": {"label_name": "x" * 5_000_000, "n": 3}}),
            "'sensitivity.by_class.1.label_name' is a text of 5000000 characters",
        ),
    ],
)
def test_publish_results_refuses_impossible_numbers_before_any_upload(manifest, tmp_path, capsys, change, named):
    """The attacker's corpus: each file fails publish-results (even a dry run) in one line naming the field."""
    result = make_results(manifest, "resnet18", 60.0)
    change(result)
    path = tmp_path / "out" / "rel" / "resnet18" / "results.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(result))  # json writes NaN and Infinity as bare tokens: what a careless tool would do
    capsys.readouterr()
    assert main(["publish-results", str(tmp_path / "out"), "--repo-id", "lance-org/lance-demo", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and str(path) in err[0], err
    # the leaderboard refuses them the same way
    assert main(["leaderboard", str(tmp_path / "out"), "--output", str(tmp_path / "lb")]) == 2
    assert named in capsys.readouterr().err and not (tmp_path / "lb").exists()


def test_published_json_is_strict():
    from builder.release_format.hub_client import json_bytes as _json_bytes

    assert json.loads(_json_bytes({"acc1": 50.0})) == {"acc1": 50.0}
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        _json_bytes({"acc1": math.nan})
