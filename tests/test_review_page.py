"""The review page for real: ``lance-cf review`` processes, Debian's chromium driven by selenium with the keyboard
alone, a killed and restarted server, the access token, paths outside the release, two reviewers at once."""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

import pytest
from builder_helpers import env
from release_fixture import write_release

from builder import release_format as rf
from builder.review.store import JudgementStore
from builder.review.study import QUESTIONS, Study

pytestmark = pytest.mark.e2e  # servers and a browser

NAMES = ["cat", "dog", "zebra"]
WAIT = 120  # seconds a page may take to react on a loaded machine before the test gives up (a guard, not a measure)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return write_release(
        tmp_path_factory.mktemp("review-page") / "rel", labels=(0, 1, 2), label_names=NAMES, edits_per_original=2
    )


class Server:
    """A ``lance-cf review`` process; ``url`` is the URL it printed (with the token)."""

    def __init__(self, release: Path, *args: str) -> None:
        command = [sys.executable, "-m", "builder.cli", "review", str(release), *args]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
        self.url = None
        for line in self.proc.stdout:  # no deadline: the server prints its URL once it listens
            if line.strip().startswith("open http"):
                self.url = line.split()[-1]
                break
        if self.url is None:
            raise AssertionError(f"lance-cf review printed no URL: {self.proc.stderr.read()[-2000:]}")
        parsed = urllib.parse.urlsplit(self.url)
        self.host, self.port = parsed.hostname, parsed.port
        self.token = urllib.parse.parse_qs(parsed.query)["token"][0]

    def request(self, method: str, path: str, body: dict | None = None, token: str | None = "own", **headers):
        connection = http.client.HTTPConnection(self.host, self.port, timeout=WAIT)
        if token is not None:
            headers["X-Review-Token"] = self.token if token == "own" else token
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        connection.request(method, path, body=data, headers=headers)  # the path is sent as given
        response = connection.getresponse()
        return response.status, response.read()

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no chance to flush anything
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture()
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.fail(
            "this test needs Debian's chromium and chromium-driver: apt-get install -y chromium chromium-driver"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-quic",
        "--no-first-run",
        "--window-size=1300,1000",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(flag)
    session = webdriver.Chrome(service=Service(driver), options=options)
    yield session
    session.quit()


def _text(browser, element_id: str, expected: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, WAIT).until(lambda b: b.find_element(By.ID, element_id).text == expected)


def _shown(browser) -> str:
    """Wait until the page has rendered a sample; its item number."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, WAIT).until(lambda b: b.execute_script("return document.body.dataset.shown"))


def _loaded_image_sizes(browser, *element_ids: str) -> list[int]:
    """The natural widths of the page's images, once every one of them has finished loading."""
    from selenium.webdriver.support.ui import WebDriverWait

    script = (
        f"return {list(element_ids)!r}.map(id => document.getElementById(id)).map(i => i.complete && i.naturalWidth)"
    )
    return WebDriverWait(browser, WAIT).until(lambda b: (sizes := b.execute_script(script)) and all(sizes) and sizes)


def _keys(browser, *keys: str) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    for key in keys:
        ActionChains(browser).send_keys(key).perform()


def test_judging_with_the_keyboard_survives_a_killed_server(release, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    total = str(3 * 2 * 2)  # classes x originals x edits: the counterfactual config
    server = Server(release, "--study-name", "page", "--questions", "still_class,realistic")
    try:
        browser.get(server.url)
        _text(browser, "total", total)
        browser.find_element(By.ID, "name-input").send_keys("alice" + Keys.ENTER)
        _text(browser, "left", total)
        _text(browser, "position", f"1 / {total}")
        _shown(browser)
        marks = [m.text for m in browser.find_elements(By.CSS_SELECTOR, "#edited-caption mark")]
        assert marks and all(m for m in marks)  # the changed span is marked
        # Both images load after the sample is shown; on a busy machine the first may still be loading.
        sizes = _loaded_image_sizes(browser, "edited-image", "original-image")
        assert sizes == [48, 48]
        _keys(browser, "1", "1", "a")  # still a cat: yes; realistic: yes; accept
        _text(browser, "left", str(int(total) - 1))
        _keys(browser, "2", "1", "r", "2")  # no; yes; reject, reason 2
        _text(browser, "left", str(int(total) - 2))
        _keys(browser, "1", "3", "f")  # yes; unsure; flag
        _text(browser, "left", str(int(total) - 3))
        _keys(browser, "a")  # no answers given: refused, nothing saved
        _text(
            browser, "message", "Answer every question first (still_class, realistic), or press f to flag the sample."
        )
        help_shown = (
            "return !document.getElementById('help').hidden && document.getElementById('help').offsetHeight > 0"
        )
        _keys(browser, "?")  # the help the footer and the terminal advertise
        WebDriverWait(browser, WAIT).until(lambda b: b.execute_script(help_shown))
        assert "flag it for a second look" in browser.find_element(By.ID, "help").text
        _keys(browser, Keys.ESCAPE)
        WebDriverWait(browser, WAIT).until(lambda b: not b.execute_script(help_shown))
        _keys(browser, Keys.BACKSPACE)
        _text(browser, "position", f"3 / {total}")
        _text(browser, "status", "judged: flag")
    finally:
        server.kill()

    # The same address (the page's storage is per origin), a new token; the stored study continues.
    restarted = Server(release, "--study-name", "page", "--port", str(server.port))
    try:
        browser.get(restarted.url)
        _text(browser, "left", str(int(total) - 3))  # the reviewer is remembered; her judgements survived the kill
        _text(browser, "position", f"4 / {total}")
        _shown(browser)
        _keys(browser, "f")  # a flag needs no answers: a second look is what it asks for
        _text(browser, "left", str(int(total) - 4))
        _keys(browser, Keys.BACKSPACE)
        _text(browser, "status", "judged: flag")
        _keys(browser, Keys.BACKSPACE, Keys.BACKSPACE)
        _text(browser, "status", "judged: reject (the edit is not visible)")
    finally:
        restarted.kill()

    manifest = rf.load_manifest(release)
    rows = JudgementStore(release, manifest.manifest_sha256).history("page")
    assert [(j.question, j.answer) for j in rows] == [
        ("still_class", "yes"), ("realistic", "yes"), ("verdict", "accept"),
        ("still_class", "no"), ("realistic", "yes"), ("verdict", "reject"),
        ("still_class", "yes"), ("realistic", "unsure"), ("verdict", "flag"),
        ("verdict", "flag"),
    ]  # fmt: skip
    assert {j.reviewer for j in rows} == {"alice"} and all(j.at.endswith("+00:00") for j in rows)
    assert rows[5].reason == "the edit is not visible" and rows[0].key != rows[3].key


def test_the_token_gates_every_request_and_no_path_leaves_the_release(release):
    server = Server(release, "--study-name", "gate")
    try:
        for path in ("/", "/api/session", "/image/0", "/static/review.js"):
            assert server.request("GET", path, token=None)[0] == 403
            assert server.request("GET", path, token="not-the-token")[0] == 403
        assert server.request("GET", f"/?token={server.token}x", token=None)[0] == 403
        assert server.request("GET", "/api/session")[0] == 200
        status, image = server.request("GET", "/image/0")
        assert status == 200 and image.startswith(b"\x89PNG")
        for path in (
            "/image/../manifest.json",
            "/static/../../manifest.json",
            "/static/..%2F..%2Fmanifest.json",
            "/static/%2e%2e/%2e%2e/etc/passwd",
            "/image/999999",
            "/image/-1",
            "/" + rf.load_manifest(release).shards_of("counterfactual")[0].path,
            "/manifest.json",
        ):
            status, body = server.request("GET", path)
            assert status == 404 and b"PNG" not in body and b"format_version" not in body, path
        assert server.request("GET", "/api/session", Host="attacker.example")[0] == 400  # DNS rebinding
        judgement = {"reviewer": "x", "item": 0, "verdict": "accept"}
        assert server.request("POST", "/api/judgement", judgement, token=None)[0] == 403
        assert server.request("POST", "/api/judgement", judgement | {"verdict": "maybe"})[0] == 400
        assert server.request("POST", "/api/judgement", judgement | {"verdict": "reject"})[0] == 400  # no reason
        assert server.request("POST", "/api/judgement", judgement | {"item": 10**6})[0] == 400
        assert server.request("POST", "/api/judgement", judgement)[0] == 200
    finally:
        server.kill()


def test_two_reviewers_at_once_on_two_servers(release):
    first, second = Server(release, "--study-name", "pair"), Server(release, "--study-name", "pair")
    try:
        items = json.loads(first.request("GET", "/api/session")[1])["study"]["items"]
        errors = []

        def judge(server: Server, reviewer: str) -> None:
            for item in range(items):
                verdict = "accept" if (item + len(reviewer)) % 3 else "flag"
                status, body = server.request("POST", "/api/judgement", {"reviewer": reviewer, "item": item,
                                                                          "verdict": verdict, "answers": {}})  # fmt: skip
                if status != 200:
                    errors.append(body)

        threads = [threading.Thread(target=judge, args=args) for args in ((first, "carol"), (second, "dave"))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        queues = [json.loads(s.request("GET", f"/api/queue?reviewer={r}")[1]) for s, r in ((second, "carol"),
                                                                                              (first, "dave"))]  # fmt: skip
        assert [q["left"] for q in queues] == [0, 0]  # each server sees what the other wrote
    finally:
        first.kill()
        second.kill()
    store = JudgementStore(release, rf.load_manifest(release).manifest_sha256)
    latest = store.latest(Study.from_dict(store.study_spec("pair")))
    assert sorted({r for r, *_ in latest}) == ["carol", "dave"] and len(latest) == 2 * items


def test_the_cli_refuses_what_it_cannot_do(release, tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "builder.cli", "review", *args], capture_output=True, text=True,
                              env=env())  # fmt: skip

    done = run(str(tmp_path))
    assert done.returncode == 2 and "not a release directory" in done.stderr
    done = run("apply", str(release))
    assert done.returncode == 2 and "needs --output" in done.stderr
    store = JudgementStore(release, rf.load_manifest(release).manifest_sha256)
    store.save_study("fixed", Study(name="fixed", questions=(QUESTIONS["still_class"],)).to_dict())
    done = run(str(release), "--study-name", "fixed", "--questions", "realistic")
    assert done.returncode == 2 and "already exists" in done.stderr
    done = run(str(release), "--questions", "colour")
    assert done.returncode == 2 and "unknown question" in done.stderr
