"""Helpers for builder tests: deterministic source folders, configs, and running the CLI in a subprocess."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

REPO = Path(__file__).resolve().parents[1]


def readme_blocks(section: str) -> list[list[str]]:
    """The ``bash`` code blocks under a README heading (any level): their commands, comments and continuations
    resolved."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for block in re.findall(r"```bash\n(.*?)```", body, re.S):
        joined = block.replace("\\\n", " ")
        blocks.append([line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()])
    return blocks


def photo(seed: int, size: tuple[int, int] = (48, 40)) -> Image.Image:
    """A deterministic RGB test picture (smooth gradients plus a seeded pattern)."""
    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) * 127 // max(w + h - 2, 1)], -1)
    noise = rng.integers(0, 40, size=(h, w, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def make_imagefolder(root: Path, classes: list[str], per_class: int, size=(48, 40)) -> Path:
    for c, name in enumerate(classes):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            photo(c * 1000 + i, size).save(folder / f"img_{i:03d}.png")
    return root


def write_config(path: Path, source: str, *, stages: list[dict] | None = None, **fields) -> Path:
    data = {
        "name": fields.pop("name", "test-release"),
        "version": fields.pop("version", "1.0.0"),
        "seed": fields.pop("seed", 0),
        "source": source,
        "configs": fields.pop("configs", ["original"]),
        "image_size": fields.pop("image_size", 32),
        "batch_size": fields.pop("batch_size", 4),
        "stages": stages or [],
        **fields,
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


FAKE_STAGES = [
    {
        "name": "caption",
        "type": "tests.fake_stages:FakeCaptionStage",
        "configs": ["reconstructed", "counterfactual", "lance_r"],
        "options": {},
    },
    {
        "name": "edit",
        "type": "tests.fake_stages:FakeEditStage",
        "configs": ["reconstructed", "counterfactual", "lance_r"],
        "options": {},
    },
]
ALL_CONFIGS = ["original", "reconstructed", "counterfactual", "lance_r"]
# The LANCE stages every full preset runs (demo and hardimagenet).
METHOD_STAGES = {"caption", "perturb", "label_check", "random_edit", "invert", "reconstruct", "edit", "lance_r_edit"}
# The release screens (lance_pipeline/screening) the LANCE presets run after the image stages.
SCREEN_STAGES = {"screen", "screen_lance_r", "safety_reconstruction", "safety", "safety_lance_r"}
STRENGTH_SCREENS = {"screen_strength", "safety_strength"}  # the demo's, which keeps the strength config
# What every preset measures on the released counterfactuals (lance_pipeline/preservation.py).
MEASURE_STAGES = {"preservation"}


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e["HF_HUB_OFFLINE"] = "1"
    return e


def cli(
    *args: str, check: bool = True, process: bool = False, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """``lance-cf ARGS`` as the user runs it (``builder.cli.main``): its exit code, stdout and stderr (with its log
    lines, as its ``logging.basicConfig`` writes them), offline, from the repository's root.

    In this process by default: a new interpreter costs seconds of imports (torch alone: 4.4 s of CPU on the 2-core
    development machine) and most tests are about the command, not the process. ``process=True`` runs
    ``python -m builder.cli`` in a new process (``timeout`` applies there), for tests about processes.
    An exception the command does not turn into an exit code is exit code 1 with its traceback on stderr, as in a
    process."""
    if process:
        proc = subprocess.run(
            [sys.executable, "-m", "builder.cli", *args],
            capture_output=True,
            text=True,
            env=env(),
            cwd=REPO,
            timeout=timeout,
        )
    else:
        proc = _in_process(list(args))
    if check and proc.returncode != 0:
        raise AssertionError(f"lance-cf {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def _in_process(args: list[str]) -> subprocess.CompletedProcess:
    import io
    import logging
    import traceback

    from huggingface_hub import constants

    from builder.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    saved_env, saved_offline, cwd = os.environ.get("HF_HUB_OFFLINE"), constants.HF_HUB_OFFLINE, os.getcwd()
    os.environ["HF_HUB_OFFLINE"], constants.HF_HUB_OFFLINE = "1", True
    root.addHandler(handler)
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = main(args)
            except SystemExit as exit_:  # argparse: --help, a usage error
                code = exit_.code if isinstance(exit_.code, int) else 1
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(cwd)
        root.removeHandler(handler)
        constants.HF_HUB_OFFLINE = saved_offline
        if saved_env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved_env
    return subprocess.CompletedProcess(["lance-cf", *args], code, stdout.getvalue(), stderr.getvalue())


def counting_loads(counts: Path, *args: str, unshared: bool = False) -> dict[str, dict[str, int]]:
    """``lance-cf ARGS`` in a process that counts every model load (tests/load_counter.py); the counts per model."""
    import json

    command = [sys.executable, str(REPO / "tests" / "load_counter.py"), str(counts)]
    command += [*(["--unshared"] if unshared else []), "--", *args]
    proc = subprocess.run(command, capture_output=True, text=True, env=env(), cwd=REPO)
    assert proc.returncode == 0, f"lance-cf {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(counts.read_text())


def release_files(root: Path) -> dict[str, str]:
    """sha256 of every published file of a release (the ledger work dir excluded)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not rel.startswith(".lance-cf/"):
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


DEMO_LIMIT = 4  # four demo photos in batches of one: enough batches for two workers and a kill


# The diffusion stages' schedule in these builds: the engine, schedule and resume comparisons need every stage and
# every config, not the preset's 10 DDIM steps with 3 null-text iterations each (the sweep's six self-replace
# fractions still give six candidates, some of them one shared render).
DEMO_DIFFUSION = {"num_inference_steps": 5, "num_inner_steps": 1}


def demo_config():
    """The demo preset's real tiny stages on four photos in batches of one, on a shorter diffusion schedule
    (``DEMO_DIFFUSION``): the ``local_demo`` fixture's config."""
    from builder.config import apply_overrides, load_config

    return short_diffusion(apply_overrides(load_config("demo"), batch_size=1, limit=DEMO_LIMIT))


def short_diffusion(config):
    """``config``, changed in place, with ``DEMO_DIFFUSION``'s values for the options its stages set (the demo's
    diffusion stages set both): for tests whose builds prove something other than the images (engines, resumes,
    model loading), compared with a build of the same config."""
    for stage in config.stages:
        shorter = {key: value for key, value in DEMO_DIFFUSION.items() if key in stage.options}
        if shorter:
            stage.options = {**stage.options, **shorter}
    return config


DEMO_INSTRUCT = "demo-instruct-b2"  # the shared_release name of demo_instruct_config()'s build


def demo_instruct_config():
    """The demo-instruct preset on four photos in batches of two: built once per session as ``DEMO_INSTRUCT``
    (``shared_release.of_config``), the reference that tests/test_instruct_editing.py resumes and rebuilds on another
    engine and schedule, and the instruction editor that tests/test_compare_editors_families.py compares."""
    from builder.config import apply_overrides, load_config

    return apply_overrides(load_config("demo-instruct"), batch_size=2, limit=4)


def ledger_rows(output: Path, table: str) -> int:
    """Rows of a ledger table of the build in ``output`` so far (read-only, sqlite's own lock wait; 0 before the
    ledger or the table exists). ``done_batches``: finished batches; ``stage_outputs``: committed stage results."""
    import sqlite3

    path = output / ".lance-cf" / "ledger.sqlite"
    if not path.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            return db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
    except sqlite3.Error:
        return 0  # tables not created yet, or the writer holds the lock: ask again on the next poll


def done_batches(output: Path) -> int:
    """Batches the build in ``output`` has finished so far."""
    return ledger_rows(output, "done_batches")


def stored_stage_outputs(output: Path) -> int:
    """Stage results committed so far (any stage, any sample): a stage-major build's progress."""
    return ledger_rows(output, "stage_outputs")


def cmdline(process) -> str:
    import psutil

    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def build_while(config, output: Path, strike, **build_kwargs) -> bool:
    """Run build() on a thread; every 0.5 s call ``strike()`` until it returns True (it did its harm: killed a
    worker, removed a node) or the build ends. Returns whether it struck; re-raises the build's error. (The 0.5 s is
    a polling interval, not a limit: the build may take as long as it needs.)"""
    import threading

    from builder.engine import build

    outcome: dict = {}

    def run():
        try:
            outcome["manifest"] = build(config, output, device="cpu", progress=False, **build_kwargs)
        except BaseException as err:  # noqa: BLE001 - re-raised on the test's thread
            outcome["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    struck = False
    while not struck:
        thread.join(0.5)  # returns at once when the build ends
        if not thread.is_alive():
            break
        struck = bool(strike())
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return struck


def build_killing_one_worker(output: Path, is_worker, min_workers: int = 2, progress=None, **build_kwargs) -> list[int]:
    """Build ``demo_config()``; once a batch is done and ``min_workers`` processes pass ``is_worker``, SIGKILL the first
    of them while later batches are still running. Returns the killed pids. ``progress(output)`` counts what must be
    done before the kill instead of the finished batches (a stage-major build finishes no batch before its last
    stage: ``stored_stage_outputs``)."""
    import os
    import signal

    import psutil

    killed: list[int] = []
    progress = progress or done_batches

    def strike() -> bool:
        if progress(output) < 1:
            return False
        workers = [p for p in psutil.Process().children(recursive=True) if is_worker(p)]
        if len(workers) >= min_workers:
            os.kill(workers[0].pid, signal.SIGKILL)
            killed.append(workers[0].pid)
        return bool(killed)

    build_while(demo_config(), output, strike, **build_kwargs)
    return killed


# A second lance-cf process holding a directory's lock as a build or an eval does, until the test closes its stdin (a
# blocking read: no poll and no deadline, so a busy machine only makes it slower).
_LOCK_HOLDER = (
    "import sys\n"
    "from builder.release_format.lock import output_lock\n"
    "with output_lock(sys.argv[1], sys.argv[2]):\n"
    "    print('held', flush=True)\n"
    "    sys.stdin.read()\n"
)


@contextlib.contextmanager
def lock_held_by_another_process(directory: Path, command: str) -> Iterator[int]:
    """Another process holds ``directory``'s lock for ``command`` ("build", "eval") inside the block; yields its pid."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, str(directory), command],
        cwd=REPO,
        env=env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.stdin.close()  # end of input: the holder leaves the lock and exits
        holder.wait()
        holder.stdout.close()


@contextlib.contextmanager
def process_held_at(pipe: Path, process: subprocess.Popen) -> Iterator[None]:
    """Returns when ``process`` has reached the named pipe ``pipe`` (a build whose fake caption stage has
    ``hold: PIPE`` opens it in its first batch) and keeps it waiting there until the block ends: a barrier, with no
    deadline and no poll. A process that exits before it gets there fails the test with its output."""

    def release_if_it_exits() -> None:
        process.wait()
        with contextlib.suppress(FileNotFoundError):
            os.close(os.open(pipe, os.O_RDONLY | os.O_NONBLOCK))  # lets the open below return

    threading.Thread(target=release_if_it_exits, daemon=True).start()
    writer = open(pipe, "w", encoding="utf-8")  # blocks until the process opens the pipe for reading
    try:
        assert process.poll() is None, f"the process exited before it reached {pipe}: {process.communicate()}"
        yield
    finally:
        os.unlink(pipe)  # later batches find no pipe and do not wait
        writer.close()  # end of input: the waiting batch goes on
