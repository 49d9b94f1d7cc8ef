"""The review's inputs as a hostile user writes them: a study file, the page's requests, a changed or garbage
``review.sqlite``. Each is refused in one line (HTTP 4xx for a request), none is taken as the reviewers' word, and no
traceback is printed or logged. The page is driven in-process through its ASGI application (no port, no thread)."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from release_fixture import write_release

from builder import release_format as rf
from builder.cli import main
from builder.review.server import MAX_BODY_BYTES, ReviewSession, create_app, open_session
from builder.review.store import JudgementStore, store_path
from builder.review.study import QUESTIONS, Study, select

TOKEN = "t" * 43


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return write_release(tmp_path_factory.mktemp("hostile") / "rel", originals_per_class=1, edits_per_original=2)


@pytest.fixture()
def fresh(release, tmp_path):
    """A copy of the release with no judgements (each test changes its database)."""
    import shutil

    copy = tmp_path / "rel"
    shutil.copytree(release, copy, ignore=shutil.ignore_patterns(rf.WORK_DIR))
    return copy


def asgi(app, method: str, path: str, body: bytes = b"", chunks: int = 1, **headers: str) -> tuple[int, bytes]:
    """One request through the ASGI application: (status, body). ``chunks`` splits the body as a client streams it."""
    raw = {"host": "127.0.0.1", "x-review-token": TOKEN, **{k.replace("_", "-"): v for k, v in headers.items()}}
    path, _, query = path.partition("?")
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in raw.items()], "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }  # fmt: skip
    size = max(1, -(-len(body) // chunks))
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def _app(release, study: Study):
    session, _ = open_session(release, study, None, None)
    return session, create_app(session, TOKEN, ["127.0.0.1"])


def _post(app, body: bytes, **headers: str) -> tuple[int, bytes]:
    return asgi(app, "POST", "/api/judgement", body, content_type="application/json", **headers)


@pytest.mark.parametrize(
    ("body", "status", "said"),
    [
        (b'{"reviewer": "al", "item": ' + b"7" * 5000 + b', "verdict": "accept"}', 400, b"an integer of 5,000 digits"),
        (b"[" * 5000 + b"]" * 5000, 400, b"nests too deeply"),  # the attack sent 100,000 levels: now a 413
        (b'{"reviewer": "al", "item": 0, "verdict": "accept", "verdict": "reject"}', 400, b"given twice"),
        (b'{"reviewer": "al", "item": 0.0, "verdict": "accept"}', 400, b"item must be an item number"),
        (b'{"reviewer": "al", "item": true, "verdict": "accept"}', 400, b"item must be an item number"),
        (b'{"reviewer": "al", "item": 0, "verdict": "maybe"}', 400, b"verdict must be one of"),
        (b'{"reviewer": "al", "item": 0, "verdict": NaN}', 400, b"is nan"),
        (b"\xff\xfe", 400, b"not UTF-8"),
    ],
)
def test_a_malformed_judgement_is_a_4xx_and_never_a_logged_traceback(fresh, caplog, body, status, said):
    _, app = _app(fresh, Study(name="s"))
    with caplog.at_level(logging.DEBUG):
        code, answer = _post(app, body)
    assert code == status and said in answer, answer[:300]
    assert len(answer) < 1000
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert JudgementStore(fresh, rf.load_manifest(fresh).manifest_sha256).history() == []


def test_a_large_body_is_refused_unread_with_or_without_a_length(fresh):
    _, app = _app(fresh, Study(name="s"))
    reason = "x" * (300 * 1024 * 1024 // 1024)  # the attack sent 300 MB; 300 KB shows the bound without the memory
    body = json.dumps({"reviewer": "al", "item": 0, "verdict": "reject", "reason": reason}).encode()
    assert _post(app, body, content_length=str(len(body)))[0] == 413
    assert _post(app, body, chunks=64)[0] == 413  # no length given: counted as it arrives
    assert _post(app, b"{}", content_length="9" * 5000)[0] == 413
    good = json.dumps({"reviewer": "al", "item": 0, "verdict": "accept"}).encode()
    assert len(good) < MAX_BODY_BYTES and _post(app, good)[0] == 200


@pytest.mark.parametrize("path", ["/api/item/" + "7" * 5000, "/api/item/-1", "/api/item/99999", "/image/1e3"])
def test_an_item_number_in_the_path_that_is_not_one_is_not_found(fresh, path):
    _, app = _app(fresh, Study(name="s"))
    assert asgi(app, "GET", path)[0] == 404
    assert asgi(app, "GET", "/api/item/0")[0] == 200


def test_a_study_that_names_its_reviewers_takes_judgements_from_them_only(fresh):
    session, app = _app(fresh, Study(name="named", reviewers=("alice", "bob")))
    judged = {"reviewer": "mallory", "item": 0, "verdict": "accept"}
    assert _post(app, json.dumps(judged).encode())[0] == 403
    assert asgi(app, "GET", "/api/queue?reviewer=mallory")[0] == 403
    assert _post(app, json.dumps({**judged, "reviewer": "alice"}).encode())[0] == 200
    assert list(session.store.latest(session.study)) == [("alice", *select(session.study, session.index)[0], "verdict")]


def _tamper(release, study: Study, reviewer: str, question: str, answer: str) -> None:
    """Append a row to review.sqlite by hand, as a user with write access to the release can."""
    JudgementStore(release, rf.load_manifest(release).manifest_sha256).save_study(study.name, study.to_dict())
    config, key = select(study, __import__("builder.review.index", fromlist=["x"]).ReleaseIndex(release))[0]
    with sqlite3.connect(store_path(release)) as db:
        db.execute(
            "INSERT INTO judgements (release, study, reviewer, config, key, question, answer, reason, at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, NULL, 'now')",
            (rf.load_manifest(release).manifest_sha256, study.name, reviewer, config, key, question, answer),
        )


@pytest.mark.parametrize(
    ("study", "row", "said"),
    [
        (Study(name="named", reviewers=("alice",)), ("eve", "verdict", "accept"), "not one of the study's reviewers"),
        (Study(name="open"), ("eve", "verdict", "approve"), "its answer is not one of accept, reject, flag"),
        (Study(name="open"), ("eve", "colour", "red"), "a question the study does not ask"),
        (Study(name="q", questions=(QUESTIONS["realistic"],)), ("eve", "realistic", "very"), "answer is not one of"),
        (Study(name="open"), ("<img src=x>", "verdict", "accept"), "not a reviewer's name"),
    ],
)
def test_a_changed_database_is_refused_in_one_line_by_every_reader(fresh, tmp_path, capsys, study, row, said):
    _tamper(fresh, study, *row)
    for args in (
        ["review", "apply", str(fresh), "--output", str(tmp_path / "new"), "--study-name", study.name],
        ["review", "agreement", str(fresh), "--study-name", study.name],
        ["review", "export", str(fresh), "--output", str(tmp_path / "j.csv")],
        ["review", str(fresh), "--study-name", study.name],
    ):
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err and "review.sqlite" in err, err
    assert not (tmp_path / "new").exists() and not (tmp_path / "j.csv").exists()


@pytest.mark.parametrize("garbage", [b"", b"not a database at all" * 100, b"SQLite format 3\x00" + b"\x07" * 5000])
def test_a_garbage_database_is_named_in_one_line_by_every_command(fresh, tmp_path, capsys, garbage):
    path = store_path(fresh)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(garbage or b"\x00" * 4096)
    for args in (
        ["review", "apply", str(fresh), "--output", str(tmp_path / "new")],
        ["review", "export", str(fresh), "--output", str(tmp_path / "j.csv")],
        ["review", "agreement", str(fresh)],
        ["review", str(fresh)],
    ):
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "review.sqlite" in err, err


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (BOMB, "expand to more than 1,000,000 values"),  # 404 bytes; the attack got a 39 MB error line
        ("seed: [1, 2]\n", "seed: expected an integer, got a list of 2"),
        ("seed: true\n", "seed: expected an integer, got True"),
        ("per_group: 2.5\n", "per_group: expected an integer"),
        ("blind: 1\n", "blind: expected true or false, got 1"),
        ("seed: 1\nseed: 2\n", "the key 'seed' is given twice"),
        ("questions: [{id: q, text: 5}]\n", "questions.0: text: expected text, got 5"),
        ("reviewers: [alice, '<b>']\n", "reviewer: a name of 1-64"),
    ],
)
def test_a_hostile_study_file_is_one_short_line(fresh, tmp_path, capsys, text, said):
    study = tmp_path / "study.yaml"
    study.write_text(text)
    assert main(["review", str(fresh), "--study", str(study)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err and len(err) < 600, err[:600]
    assert not store_path(fresh).exists() or JudgementStore(fresh, "x").studies() == []


def test_a_bad_port_is_refused_by_the_parser(fresh, capsys):
    for port in ("70000", "-1", "9" * 5000, "http"):
        with pytest.raises(SystemExit) as exit_info:
            main(["review", str(fresh), "--port", port])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "argument --port" in err, err[:300]


def test_a_study_stored_before_reviewer_lists_continues(fresh):
    """A spec stored without ``reviewers`` is the same study (continued by name, not refused as changed)."""
    store = JudgementStore(fresh, rf.load_manifest(fresh).manifest_sha256)
    spec = Study(name="old", seed=3).to_dict()
    assert "reviewers" not in spec
    store.save_study("old", spec)
    session, _ = open_session(fresh, None, "old", None)
    assert isinstance(session, ReviewSession) and session.study.seed == 3


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
JUDGEMENT = st.fixed_dictionaries(
    {},
    optional={
        "reviewer": st.sampled_from(["al", "", " ", "<b>", "x" * 70]) | JSON_VALUES,
        "item": st.integers(-3, 10**30) | JSON_VALUES,
        "verdict": st.sampled_from(["accept", "reject", "flag", "maybe"]) | JSON_VALUES,
        "reason": st.text(max_size=600) | JSON_VALUES,
        "answers": JSON_VALUES,
    },
)


_APPS: dict = {}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=JUDGEMENT | JSON_VALUES)
def test_fuzz_the_judgement_endpoint_answers_200_or_4xx(release, body):
    """Any JSON body: stored (200) or refused (4xx) with a short message; never a 500."""
    if release not in _APPS:
        _APPS[release] = _app(release, Study(name="fuzz"))[1]
    app = _APPS[release]
    code, answer = _post(app, json.dumps(body).encode())
    assert code == 200 or 400 <= code < 500, (code, answer[:300])
    assert len(answer) < 1000
