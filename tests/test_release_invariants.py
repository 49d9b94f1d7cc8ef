"""The release's declared invariants (``builder.release_format`` ``FieldSpec`` ranges and references, ``ConfigSpec``
relations, ``InvariantCheck``), held at the three places a release is judged: the writer refuses a sample that breaks
one, ``lance-cf verify`` names every breach by key, ``lance-cf eval`` refuses the release unless ``--no-verify``.

The strength config is the attacked surface: a strength of 5.0, -0.2, 0 or NaN, a ``counterfactual_key`` naming no
sample, a candidate duplicated, every or no candidate ``selected``. Releases are written through the release format
(tests/release_fixture.py) and a strength config is added to them the way an attacker would: raw JSON in a shard, the
manifest re-sealed, so that only the attacked invariant is wrong.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from release_fixture import write_release

from builder import release_format as rf
from builder.cli import main
from builder.release import seal_release
from builder.validation import declared_config
from lance_pipeline.editing.strength import STRENGTH_OUTPUT

STRENGTH = declared_config(STRENGTH_OUTPUT, STRENGTH_OUTPUT.description)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A release of originals and counterfactuals (3 classes x 2 images, 2 edits each), written once."""
    return write_release(
        tmp_path_factory.mktemp("base") / "release",
        configs=("original", "counterfactual"),
        originals_per_class=2,
        edits_per_original=2,
        label_names=["cat", "dog", "fox", "owl"],
        labels=(0, 1, 2),
        image_size=16,
    )


def _samples(root: Path, config: str) -> list[tuple[str, bytes, dict]]:
    manifest = rf.load_manifest(root)
    out = []
    for shard in manifest.shards:
        if shard.config == config:
            for key, members in rf.iter_shard(root / shard.path):
                out.append((key, members[manifest.image_ext], json.loads(members[rf.METADATA_EXT])))
    return out


def strength_rows(root: Path) -> list[dict]:
    """A valid strength config: each counterfactual's edit at strengths 0.2, 0.4, 0.6, the 0.4 one selected."""
    rows = []
    for key, _, meta in _samples(root, "counterfactual"):
        for i, strength in enumerate((0.2, 0.4, 0.6)):
            rows.append(
                {
                    **meta,
                    "key": f"{key}_st{i:03d}",
                    "self_replace": round(1 - strength, 10),
                    "editor": "prompt_to_prompt",
                    "strength": strength,
                    "edit_index": 0,
                    "selected": i == 1,
                    "counterfactual_key": key,
                }
            )
    return rows


def add_strength(base: Path, root: Path, rows: list[dict]) -> Path:
    """A copy of ``base`` at ``root`` with a strength config holding ``rows`` as they are (raw JSON, NaN allowed),
    declared as the build declares it, the manifest re-sealed."""
    import shutil

    shutil.copytree(base, root)
    manifest = json.loads((root / rf.MANIFEST_NAME).read_text())
    spec = rf.ReleaseSpec.from_dict(manifest["release_spec"])
    spec = rf.ReleaseSpec((*spec.configs, STRENGTH), spec.edit_types, spec.score_names)
    image = _samples(base, "original")[0][1]
    tally = rf.Tally()
    samples = []
    for meta in rows:
        tally.add(meta["label"], meta.get("edit_type"))
        samples.append(rf.ShardSample(meta["key"], "png", image, meta["label"], json.dumps(meta).encode()))
    manifest["shards"].append(rf.write_shard(root, "strength", 0, samples).to_dict())
    manifest["configs"].append("strength")
    manifest["counts"]["strength"] = tally.to_dict()
    manifest["release_spec"] = spec.to_dict()
    rf.seal_manifest(manifest)
    (root / rf.MANIFEST_NAME).write_bytes(rf.canonical_json(manifest))
    return root


def writer_problems(base: Path, rows: list[dict]) -> list[str]:
    """What the writer says of these samples: each is encoded (refused one by one) and checked as a release's writer
    checks it before sealing."""
    manifest = rf.load_manifest(base)
    spec = rf.ReleaseSpec((*manifest.release_spec.configs, STRENGTH), manifest.release_spec.edit_types)
    check = rf.InvariantCheck(spec, [*manifest.configs, "strength"])
    for config in manifest.configs:
        for _, _, meta in _samples(base, config):
            check.add(config, meta)
    problems = []
    for meta in rows:
        try:
            rf.encode_metadata(meta, spec, "strength")
        except ValueError as err:
            problems.append(f"strength:{meta['key']}: {err}")
        check.add("strength", meta)
    return problems + check.problems()


def _verify(capsys, release: Path) -> tuple[int, str]:
    code = main(["verify", str(release), "--skip-images"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _first_key(rows: list[dict], n: int = 0) -> str:
    return rows[n]["key"]


# (what is wrong, how to break valid rows, the words the refusal must hold (with {key}: the broken sample's key))
ATTACKS = {
    "strength 5.0": (lambda r: r[0].update(strength=5.0), ["{key}", "'strength' is 5.0", "(0, 1]"]),
    "negative strength": (lambda r: r[0].update(strength=-0.2), ["{key}", "'strength' is -0.2"]),
    "strength 0": (lambda r: r[0].update(strength=0.0), ["{key}", "'strength' is 0.0"]),
    # the writer says "'strength' is nan, expected a finite number"; verify's JSON reader refuses the NaN itself
    "NaN strength": (lambda r: r[0].update(strength=math.nan), ["{key}"]),
    "infinite score": (lambda r: r[0].update(scores={**r[0]["scores"], "clip_image": math.inf}), ["{key}"]),
    "dangling counterfactual_key": (
        lambda r: r[0].update(counterfactual_key="src-0000-00-cf99"),
        ["{key}", "counterfactual_key 'src-0000-00-cf99' names no sample of config counterfactual"],
    ),
    "duplicated candidate": (
        lambda r: r.append({**r[0], "key": r[0]["key"] + "x"}),
        ["{key}x", "is also sample '{key}'", "declared unique in strength"],
    ),
    "every candidate selected": (
        lambda r: [row.update(selected=True) for row in r[:3]],
        ["3 samples with counterfactual_key=", "have selected true", "expected exactly one"],
    ),
    "no candidate selected": (lambda r: r[1].update(selected=False), ["0 samples with", "expected exactly one"]),
    # the writer says "duplicate key in config strength"; a shard holding one key twice is unreadable past it
    "duplicate sample key": (lambda r: r.append(dict(r[4])), ["{key4}"]),
    "a derived sample with no original": (
        lambda r: r[0].update(source_key="nowhere"),
        ["{key}", "source_key 'nowhere' has no original sample"],
    ),
}


def _words(words: list[str], rows: list[dict]) -> list[str]:
    return [w.format(key=rows[0]["key"], key4=rows[4]["key"]) for w in words]


def test_the_writer_refuses_a_nan_or_an_infinity_naming_the_field(base):
    rows = strength_rows(base)
    rows[0]["strength"] = math.nan
    rows[1]["scores"] = {**rows[1]["scores"], "clip_image": math.inf}
    written = "\n".join(writer_problems(base, rows))
    assert "'strength' is nan, expected a finite number" in written and rows[0]["key"] in written
    assert "'scores.clip_image' is inf, expected a finite number" in written and rows[1]["key"] in written


def test_a_valid_strength_config_passes_the_writer_verify_and_eval_gate(base, tmp_path, capsys):
    rows = strength_rows(base)
    assert writer_problems(base, rows) == []
    release = add_strength(base, tmp_path / "release", rows)
    assert rf.invariant_problems(release) == []
    _, text = _verify(capsys, release)
    # the copy's card and croissant.json were written before the strength config was added: only they differ
    assert "_st0" not in text, text


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_every_breach_is_refused_by_the_writer_and_named_by_key_by_verify(base, tmp_path, capsys, attack):
    rows = strength_rows(base)
    ATTACKS[attack][0](rows)
    words = _words(ATTACKS[attack][1], rows)
    written = "\n".join(writer_problems(base, rows))
    assert all(w in written for w in words), written
    release = add_strength(base, tmp_path / "release", rows)
    code, text = _verify(capsys, release)
    assert code == 1
    assert all(w in text for w in words), text
    found = "\n".join(rf.invariant_problems(release))  # what eval checks before it scores
    assert all(w in found for w in words), found


def _eval_argv(base: Path, tmp_path: Path) -> tuple[list[str], Path, str]:
    rows = strength_rows(base)
    rows[0]["strength"] = 5.0
    release = add_strength(base, tmp_path / "release", rows)
    out = tmp_path / "eval"
    (tmp_path / "map.txt").write_text("0\n1\n2\n3\n")  # the fixture's four labels -> the model's first outputs
    argv = ["eval", "--release", str(release), "--model", "test_vit", "--no-pretrained", "--output", str(out)]
    argv += ["--no-insights", "--no-report", "--workers", "0", "--bootstrap", "0"]
    return [*argv, "--class-map", str(tmp_path / "map.txt")], out, rows[0]["key"]


def test_eval_refuses_a_release_that_breaks_its_invariants_before_any_model(base, tmp_path, capsys):
    argv, out, key = _eval_argv(base, tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "breaks its declared invariants" in err and key in err and "--no-verify" in err
    assert not list(out.rglob("results.json"))


@pytest.mark.slow
def test_eval_with_no_verify_scores_it_and_records_that(base, tmp_path):
    argv, out, _ = _eval_argv(base, tmp_path)
    assert main([*argv, "--no-verify"]) == 0
    results = json.loads(next(out.rglob("results.json")).read_text())
    assert results["options"]["verify"] is False


def test_seal_release_refuses_a_writer_whose_samples_did_not_all_go_through_the_check(base, tmp_path):
    manifest = json.loads((base / rf.MANIFEST_NAME).read_text())
    spec = rf.ReleaseSpec.from_dict(manifest["release_spec"])
    check = rf.InvariantCheck(spec, manifest["configs"])
    for _, _, meta in _samples(base, "original"):  # the counterfactuals bypass it
        check.add("original", meta)
    with pytest.raises(ValueError, match="every sample a writer writes must go through InvariantCheck.add"):
        seal_release(tmp_path / "out", manifest, check)
    for _, _, meta in _samples(base, "counterfactual"):
        meta["source_key"] = "gone"
        check.add("counterfactual", meta)
    with pytest.raises(ValueError, match="refusing to write a release that breaks its declared invariants: "):
        seal_release(tmp_path / "out", manifest, check)
    assert not (tmp_path / "out" / rf.MANIFEST_NAME).exists()


def test_the_declaration_round_trips_through_the_manifest_and_refuses_a_bad_one():
    spec = rf.ReleaseSpec((STRENGTH,))
    assert rf.ReleaseSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    declared = spec.to_dict()["configs"]["strength"]
    strength = next(f for f in declared["fields"] if f["name"] == "strength")
    assert (strength["minimum"], strength["minimum_exclusive"], strength["maximum"]) == (0.0, True, 1.0)
    assert declared["one_true_per"] == [["selected", "counterfactual_key"]]
    # fields without a range keep the bytes they always had
    assert rf.FieldSpec("editor", "string").to_dict() == {
        "name": "editor",
        "dtype": "string",
        "enum": None,
        "description": "",
    }
    with pytest.raises(ValueError, match="not a finite number"):
        rf.FieldSpec("x", "float64", minimum=math.nan)
    with pytest.raises(ValueError, match="is not a bool field"):
        rf.ConfigSpec("c", "d", (rf.FieldSpec("x", "string"),), one_true_per=(("x", "key"),))
    with pytest.raises(ValueError, match="names no declared field"):
        rf.ConfigSpec("c", "d", (), unique=(("nope",),))


def test_a_flagged_selected_candidate_takes_its_edit_series_with_it():
    """The safety screen of the strength config: the selected candidate is the counterfactual's image; when it is
    flagged, the edit's other candidates would link to a sample that is not released, so they are removed too."""
    from lance_pipeline.screening.safety_checker import StrengthSafetyCheckStage

    stage = StrengthSafetyCheckStage.__new__(StrengthSafetyCheckStage)
    items = [
        {"image": None, "edited_caption": "a", "counterfactual_key": "k_cf000", "selected": s}
        for s in (False, True, False)
    ] + [{"image": None, "edited_caption": "b", "counterfactual_key": "k_cf001", "selected": True}]
    record = {STRENGTH_OUTPUT.field: items}
    update = stage._update(record, [(False, 0.1), (True, 0.9), (False, 0.2), (False, 0.3)])
    assert [i["counterfactual_key"] for i in update[STRENGTH_OUTPUT.field]] == ["k_cf001"]
    removed = update[stage.removed_field]
    assert sorted(r["index"] for r in removed) == [0, 1, 2]
    assert sum("selected candidate" in r["reason"] for r in removed) == 2


# -- property: whatever the samples, the writer and verify agree ------------------------------------------------------
_FLOATS = st.one_of(
    st.sampled_from([0.2, 0.4, 0.6, 1.0, 0.0, -0.1, 5.0, math.nan, math.inf]),
    st.floats(min_value=-2, max_value=2, allow_nan=False),
)


@st.composite
def strength_configs(draw, counterfactuals: list[str]):
    n = draw(st.integers(min_value=1, max_value=6))
    rows = []
    for i in range(n):
        cf = draw(st.sampled_from([*counterfactuals[:2], "src-0000-00-cf99"]))
        rows.append(
            {
                "key": draw(st.sampled_from([f"s{i}", "s0"])),
                "strength": draw(_FLOATS),
                "selected": draw(st.booleans()),
                "counterfactual_key": cf,
            }
        )
    return rows


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_generated_strength_samples_pass_both_or_are_refused_by_both_naming_the_same_keys(base, tmp_path, data):
    counterfactuals = [key for key, _, _ in _samples(base, "counterfactual")]
    metas = {key: meta for key, _, meta in _samples(base, "counterfactual")}
    drawn = data.draw(strength_configs(counterfactuals))
    rows = [
        {
            **metas[counterfactuals[0]],
            **d,
            "key": f"{counterfactuals[0]}_{d['key']}",
            "self_replace": None,
            "editor": "prompt_to_prompt",
            "edit_index": 0,
        }
        for d in drawn
    ]
    written = writer_problems(base, rows)
    root = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
    found = rf.invariant_problems(add_strength(base, root, rows))
    assert bool(written) == bool(found), (written, found)
    keys = [r["key"] for r in rows]
    twice = {k for k in keys if keys.count(k) > 1}
    if twice:  # the shard is unreadable from the second copy on: both name the key, verify nothing after it
        assert all(any(k in p for p in written) and any(k in p for p in found) for k in twice)
        return
    named = {k for k in keys if any(k in p for p in written)}
    assert named == {k for k in keys if any(k in p for p in found)}
