"""The one reader of structured input (``lance_pipeline.readers``): every YAML, JSON and JSON-lines input goes through
it, and it refuses what would blow up, hang or be silently coerced, in one line naming the input and the field.

The scan below fails when code reads with ``yaml.safe_load``, ``yaml.load``, ``json.load`` or ``json.loads`` outside
the reader, unless the place is in ``NOT_USER_INPUT`` with the reason its text is not user input. The fuzz tests
(hypothesis) feed each reader arbitrary text and values: it returns a value or raises ``InputError``, nothing else.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lance_pipeline.readers import (
    MAX_DEPTH,
    MAX_VALUES,
    InputError,
    expect_bool,
    expect_int,
    expect_number,
    expect_str,
    load_json,
    load_json_lines,
    load_yaml,
    read_json,
    read_text,
    read_yaml,
)

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("builder", "lance_pipeline", "evaluation", "dataset_cards")
READER = "lance_pipeline/readers/structured.py"
FORBIDDEN = {
    "yaml": {"safe_load", "load", "full_load", "unsafe_load", "load_all", "safe_load_all", "full_load_all"},
    "json": {"load", "loads", "JSONDecoder"},
}

# (file, enclosing function) -> why the text parsed there is not user input. Everything else reads through the reader.
NOT_USER_INPUT: dict[tuple[str, str], str] = {
    # The ledger's own payloads in its SQLite database, encoded by the same module.
    ("builder/ledger.py", "payload_structure"): "the ledger's own payload encoding",
    ("builder/ledger.py", "decode_payload"): "the ledger's own payload encoding",
    # The build's own records in its ledger's meta table (config, environment, descriptions, peak memory).
    ("builder/engine.py", "describe"): "the ledger's meta table, written by the build",
    ("builder/engine.py", "_claim_ledger"): "the ledger's meta table, written by the build",
    ("builder/engine.py", "_stage_memory"): "the ledger's meta table, written by the build",
    ("builder/engine.py", "commit_stage"): "the ledger's meta table, written by the build",
    # A round trip of a value this process just serialised with canonical_json.
    ("builder/croissant.py", "croissant_about"): "canonical_json of the manifest in memory",
    # Package data shipped with the tool (not a file a user passes).
    ("builder/imagenet.py", "_classes"): "package data: imagenet_classes.json",
    ("builder/discovery/cli.py", "imagenet_superclasses"): "package data: imagenet_superclasses.json",
    # The lock's own record beside the directory it locks, written by the same module.
    ("builder/release_format/lock.py", "_read_info"): "the lock's own info file",
    # Tiny random-weight components built for the tests and demos by the same module.
    ("lance_pipeline/tiny/image_components.py", "create_tiny_stable_diffusion"): "a vocabulary this module wrote",
    ("lance_pipeline/tiny/text_components.py", "create_tiny_lora_adapter"): "an adapter config this module wrote",
    ("lance_pipeline/tiny/instruct_components.py", "create_tiny_instruct_pix2pix"): (
        "the configs create_tiny_stable_diffusion just wrote"
    ),
    # A server's own JSON response (a chat-completions server), not a file a user passes.
    ("lance_pipeline/perturber/collect.py", "_chat_content"): "the chat-completions server's JSON response",
    # A language model's reply, parsed leniently (JSON, else a Python literal) and validated field by field after.
    ("lance_pipeline/dillema/text_stages.py", "parse_json_answer"): "a language model's reply, checked field by field",
}


def forbidden_reads(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of every use of a forbidden parser in ``path``: calls, references and imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if (
                isinstance(child, ast.Attribute)
                and isinstance(child.value, ast.Name)
                and child.attr in FORBIDDEN.get(child.value.id, ())
            ):
                found.append((function, child.lineno))
            elif isinstance(child, ast.ImportFrom) and child.module in FORBIDDEN:
                if any(alias.name in FORBIDDEN[child.module] for alias in child.names):
                    found.append((function, child.lineno))
            visit(child, inner)

    visit(tree, "<module>")
    return found


@pytest.mark.slow
def test_no_code_reads_structured_input_outside_the_reader():
    unlisted, listed = [], set()
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = path.relative_to(REPO).as_posix()
            if name == READER:
                continue
            for function, line in forbidden_reads(path):
                if (name, function) in NOT_USER_INPUT:
                    listed.add((name, function))
                else:
                    unlisted.append(f"{name}:{line} ({function})")
    assert not unlisted, (
        "read user input with lance_pipeline.readers (read_json, load_json, read_yaml, load_yaml, read_json_lines), "
        "or list the place in NOT_USER_INPUT with the reason its text is not user input:\n" + "\n".join(unlisted)
    )
    stale = sorted(set(NOT_USER_INPUT) - listed)
    assert not stale, f"NOT_USER_INPUT entries that no longer parse anything (remove them): {stale}"


def test_the_scan_sees_calls_references_and_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import json, yaml\nfrom json import loads\n"
        "def f(t):\n    return yaml.safe_load(t)\n"
        "def g(t):\n    readers = (json.loads, str)\n    return json.load(t)\n"
    )
    assert forbidden_reads(module) == [("<module>", 2), ("f", 4), ("g", 6), ("g", 7)]


# -- the refusals ------------------------------------------------------------------------------------------------------
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)


@pytest.mark.parametrize(
    ("reader", "text", "expected"),
    [
        (load_yaml, BOMB, f"expand to more than {MAX_VALUES:,} values"),
        (load_yaml, "a: &a [*a]\n", "contains itself"),
        (load_yaml, "seed: 1\nseed: 2\n", "the key 'seed' is given twice"),
        (load_yaml, "x: .nan\n", "'x' is nan"),
        (load_yaml, "x: [1, 2, .inf]\n", "'x.2' is inf"),
        (load_yaml, "x: " + "9" * 60 + "\n", "'x' is an integer of more than"),
        (load_yaml, "[" * 5000 + "]" * 5000, "not valid YAML"),
        (load_json, '{"0": 281, "0": 207}', "the key '0' is given twice"),
        (load_json, '{"a": [NaN]}', "'a.0' is nan"),
        (load_json, '{"a": 1e999}', "'a' is inf"),
        (load_json, '{"item": ' + "7" * 5000 + "}", "an integer of 5,000 digits"),
        (load_json, "[" * 100_000 + "]" * 100_000, "nests too deeply"),
        (load_json, "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"nests deeper than {MAX_DEPTH} levels"),
        (load_json, b"\xff\xfe", "not UTF-8"),
        (load_json, "{'a': 1}", "not valid JSON"),
        (load_json_lines, '{"a": 1}\n\n{"a": 2, "a": 3}\n', "t: line 3: the key 'a' is given twice"),
    ],
)
def test_each_refusal_is_one_line_naming_the_input(reader, text, expected):
    with pytest.raises(InputError) as caught:
        reader(text, "t")
    message = str(caught.value)
    assert message.startswith("t") and expected in message, message
    assert "\n" not in message and len(message) < 500


def test_size_is_bounded_before_a_file_is_read(tmp_path):
    path = tmp_path / "big.json"
    path.write_text("[" + "1," * 600 + "1]")
    with pytest.raises(InputError, match=r"big.json: larger than 1,000 bytes"):
        read_json(path, max_bytes=1000)
    assert len(read_json(path, max_bytes=2000)) == 601
    with pytest.raises(InputError, match="no such file"):
        read_yaml(tmp_path / "missing.yaml")
    with pytest.raises(InputError, match="a directory"):
        read_text(tmp_path)
    with pytest.raises(InputError, match="larger than 10 bytes"):
        load_yaml("a: " + "x" * 20, "t", max_bytes=10)


def test_ordinary_documents_read_as_before():
    assert load_yaml("a: &a [1, 2]\nb: *a\n", "t") == {"a": [1, 2], "b": [1, 2]}
    assert load_yaml("base: &b {x: 1, y: 2}\nc:\n  <<: *b\n  y: 3\n", "t")["c"] == {"x": 1, "y": 3}
    assert load_json('{"a": [1, 2.5, null, true, "x"]}', "t") == {"a": [1, 2.5, None, True, "x"]}
    assert load_json_lines('{"a": 1}\n{"a": 2}\n', "t") == [{"a": 1}, {"a": 2}]
    assert load_yaml("", "t") is None


def test_fields_are_checked_without_coercion():
    assert expect_int(281, "m: 0") == 281
    for value in (207.9, 2.0, True, "3", None):
        with pytest.raises(InputError, match="m: 1: expected an integer"):
            expect_int(value, "m: 1")
    with pytest.raises(InputError, match="expected an integer in 0 to 999, got 1000"):
        expect_int(1000, "m", minimum=0, maximum=999)
    for value in (True, "1", math.nan, math.inf):
        with pytest.raises(InputError, match="expected a finite number"):
            expect_number(value, "x")
    with pytest.raises(InputError, match="expected true or false, got 1"):
        expect_bool(1, "blind")
    with pytest.raises(InputError, match="a list of 2 value"):
        expect_str([1, 2], "seed")


# -- fuzzing (hypothesis): a reader returns a value or raises InputError, whatever it is given ---------------------------
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=30,
)
# Text near the formats' syntax finds more of the parsers' corners than uniformly random characters.
SYNTAX = st.text(alphabet=st.sampled_from(list("{}[]:,\"'&*!-? \n\t.0123456789eE+naNIfy<>#|%@`\\x\x00é")), max_size=80)


def _reads_or_refuses(reader, text) -> object:
    try:
        return reader(text, "fuzz")
    except InputError as err:
        assert "\n" not in str(err) and str(err).startswith("fuzz"), str(err)
        return err


@FUZZ
@given(st.one_of(SYNTAX, st.text(max_size=80), st.binary(max_size=80)))
def test_fuzz_each_reader_returns_a_value_or_refuses_in_one_line(text):
    for reader in (load_json, load_json_lines, load_yaml):
        _reads_or_refuses(reader, text)


@FUZZ
@given(JSON_VALUES)
def test_fuzz_json_round_trips_exactly_what_it_accepts(value):
    """What ``json.dumps`` writes is read back equal, or refused for a reason the reader states (non-finite floats,
    oversized integers, too deep): never coerced."""
    text = json.dumps(value)
    result = _reads_or_refuses(load_json, text)
    finite = all(not isinstance(v, float) or math.isfinite(v) for v in _leaves(value)) and all(
        not isinstance(v, int) or abs(v) < 10**40 for v in _leaves(value)
    )
    if finite:
        assert result == value
    else:
        assert isinstance(result, InputError)


@FUZZ
@given(JSON_VALUES)
def test_fuzz_yaml_reads_what_yaml_writes(value):
    import yaml

    text = yaml.safe_dump(value)
    result = _reads_or_refuses(load_yaml, text)
    if not isinstance(result, InputError):
        assert result == value or _has_nan(value)


@FUZZ
@given(st.lists(st.sampled_from(["a", "b", "c"]), min_size=2, max_size=6))
def test_fuzz_duplicate_keys_are_refused_in_both_formats(keys):
    duplicated = len(set(keys)) != len(keys)
    as_json = "{" + ", ".join(f'"{k}": {i}' for i, k in enumerate(keys)) + "}"
    as_yaml = "\n".join(f"{k}: {i}" for i, k in enumerate(keys))
    for reader, text in ((load_json, as_json), (load_yaml, as_yaml)):
        result = _reads_or_refuses(reader, text)
        assert isinstance(result, InputError) == duplicated
        if duplicated:
            assert "is given twice" in str(result)


def _leaves(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _has_nan(value) -> bool:
    return any(isinstance(v, float) and math.isnan(v) for v in _leaves(value))


# -- the readers of each format, through the one reader ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"0": 281, "1": 207.9}', "label 1: expected an integer, got 207.9"),
        ('{"0": 281, "1": true}', "label 1: expected an integer, got True"),
        ('{"0": 281, "1": 207, "1": 208}', "the key '1' is given twice"),
        ('{"0": 281, "01": 207}', "key '01' is not a release label"),
        ('{"0": 281, "1": 207, "2": 3}', "key '2' is not a release label"),
        ('{"0": 281, "1": -4}', "expected an integer in 0 to"),
        ("[281, 207]", "expected a mapping"),
    ],
)
def test_a_json_class_map_is_read_strictly(tmp_path, text, expected):
    from evaluation.models import load_class_map

    path = tmp_path / "map.json"
    path.write_text(text)
    with pytest.raises(ValueError) as caught:
        load_class_map(path, 2)
    assert expected in str(caught.value) and "map.json" in str(caught.value), str(caught.value)
    path.write_text('{"1": 207, "0": 281}')
    assert load_class_map(path, 2) == [281, 207]


@FUZZ
@given(st.dictionaries(st.sampled_from(["0", "1", "2", "01", "x"]), JSON_VALUES, max_size=4))
def test_fuzz_a_json_class_map_gives_integers_or_one_line(tmp_path_factory, mapping):
    from evaluation.models import load_class_map

    path = tmp_path_factory.mktemp("map") / "map.json"
    path.write_text(json.dumps(mapping))
    try:
        indices = load_class_map(path, 2)
    except ValueError as err:
        assert "\n" not in str(err) and "map.json" in str(err)
        return
    assert all(type(i) is int and i >= 0 for i in indices) and len(indices) == 2
    assert indices == [mapping["0"], mapping["1"]]


STUDY_KEYS = ["name", "questions", "configs", "per_group", "group_by", "seed", "blind", "shuffle", "show_original",
              "reviewers", "colour"]  # fmt: skip
QUESTION = st.fixed_dictionaries(
    {"id": st.sampled_from(["q", "1q", "verdict", 5]), "text": JSON_VALUES},
    optional={"answers": st.lists(JSON_VALUES, max_size=4)},
)


@FUZZ
@given(st.dictionaries(st.sampled_from(STUDY_KEYS), JSON_VALUES | st.lists(QUESTION, max_size=2), max_size=6))
def test_fuzz_a_study_is_built_with_its_types_or_refused_in_one_line(tmp_path_factory, settings_given):
    """The review's study reader: settings of any type give a Study whose fields have their declared types, or one
    ``ValueError`` line (through the YAML file too)."""
    import yaml

    from builder.review.study import Study

    path = tmp_path_factory.mktemp("study") / "study.yaml"
    path.write_text(yaml.safe_dump(settings_given))
    for read in (lambda: Study.from_dict(settings_given, "s"), lambda: Study.from_file(path)):
        try:
            study = read()
        except ValueError as err:
            assert "\n" not in str(err) and len(str(err)) < 1000, str(err)[:300]
            continue
        assert type(study.seed) is int and type(study.blind) is bool and type(study.shuffle) is bool
        assert study.per_group is None or type(study.per_group) is int
        assert all(type(c) is str for c in study.configs) and all(type(r) is str for r in study.reviewers)
        assert all(type(q.text) is str and all(type(a) is str for a in q.answers) for q in study.questions)


MANIFEST_KEYS = ["format_version", "name", "version", "configs", "shards", "label_space", "manifest_sha256", "counts",
                 "release_spec", "kind", "build", "colour"]  # fmt: skip


@FUZZ
@given(st.dictionaries(st.sampled_from(MANIFEST_KEYS), JSON_VALUES, max_size=8) | JSON_VALUES)
def test_fuzz_a_manifest_loads_or_is_refused_in_one_line(tmp_path_factory, data):
    from builder.release_format.manifest import load_manifest

    root = tmp_path_factory.mktemp("release")
    (root / "manifest.json").write_text(json.dumps(data))
    try:
        load_manifest(root)
    except ValueError as err:
        assert "\n" not in str(err) and "manifest.json" in str(err), str(err)[:300]


@FUZZ
@given(
    st.dictionaries(st.sampled_from(["repo_id", "revision", "commit", "files", "sha256", "x"]), JSON_VALUES)
    | JSON_VALUES
)
def test_fuzz_a_model_marker_is_trusted_or_not_never_a_crash(tmp_path_factory, data):
    """``.lance-cf-model.json`` of any content: ``local_copy`` says whether the directory is a copy, or refuses in one
    line; it never raises anything else."""
    from lance_pipeline.models.hub_cache import LOCAL_MARKER, local_copy

    root = tmp_path_factory.mktemp("copy")
    (root / LOCAL_MARKER).write_text(json.dumps(data))
    try:
        local_copy(root)
    except ValueError as err:
        assert "\n" not in str(err)
