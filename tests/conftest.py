"""Test-wide settings: everything offline, caches inside the test session's temporary directory."""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Test configs name test-only stage classes by ``module:attr`` (tests.fake_stages), which is code: allowed for the
# suite; tests of the refusal unset it (tests/test_builder_contract.py).
os.environ.setdefault("LANCE_CF_ALLOW_CODE", "1")

# Tiny demo components are built into a per-session cache, not the user's ~/.cache/lance-cf.
if "LANCE_CF_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="lance-cf-test-cache-")
    os.environ["LANCE_CF_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# Releases built once per session (``shared_release``). Like the cache, the folder is made by the process that loads
# this file first: under pytest-xdist that is the controller, whose environment every worker inherits, so all workers
# share one folder and one build of each release.
if "LANCE_CF_TEST_RELEASES" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _releases = tempfile.mkdtemp(prefix="lance-cf-test-releases-")
    os.environ["LANCE_CF_TEST_RELEASES"] = _releases
    atexit.register(shutil.rmtree, _releases, ignore_errors=True)


# -- the Hub double (tests/hub_double.py) and the environment that points huggingface_hub at it ---------------------
@pytest.fixture
def hub(tmp_path: Path):
    """A Hub double on 127.0.0.1 with a git repository per Hub repo; writes need ``hub_double.TOKEN``."""
    from hub_double import TOKEN, HubDouble

    double = HubDouble(tmp_path / "hub", token=TOKEN).start()
    yield double
    double.stop()


@pytest.fixture
def hub_env(hub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """``hub``, with this process's huggingface_hub pointed at it: online, ``HF_ENDPOINT`` (the project's Hub client
    reads it at call time; huggingface_hub's own ``constants.ENDPOINT`` was fixed at import), the double's token in ``HF_TOKEN``, an
    empty ``HF_HOME``, no proxies, no Xet, no progress bars. Subprocesses get theirs from ``hub_double.client_env``."""
    from hub_double import TOKEN
    from huggingface_hub import constants

    for key in [k for k in os.environ if k.lower().endswith("_proxy")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home_in_process"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", True)
    return hub


# -- the lance-cf command line, run in this process -----------------------------------------------------------------
class CliRunner:
    """``lance-cf`` in this process: ``cli("eval", ...)`` parses with the real parser (``builder.cli.build_parser``,
    every subcommand) and returns the command's exit code; ``cli.parse([...])`` gives the parsed arguments. Unlike
    ``builder.cli.main`` nothing is caught: a test sees the exception a command raises."""

    @functools.cached_property
    def parser(self) -> argparse.ArgumentParser:
        from builder.cli import build_parser

        return build_parser()

    def parse(self, argv: list[str]) -> argparse.Namespace:
        return self.parser.parse_args([str(arg) for arg in argv])

    def __call__(self, *argv: str) -> int:
        args = self.parse(list(argv))
        return int(args.func(args) or 0)


@pytest.fixture(scope="session")
def cli() -> CliRunner:
    return CliRunner()


@pytest.fixture
def lance_cf(capsys: pytest.CaptureFixture[str]):
    """``lance-cf ARGS`` as a user runs it (``builder.cli.main``: bad input is exit code 2 and one line, an argparse
    error exits 2), in this process: ``code, out, err = lance_cf("verify", str(release))``."""
    from builder.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = main([str(arg) for arg in args])
        except SystemExit as exit_:  # argparse: a usage error, --help
            code = exit_.code if isinstance(exit_.code, int) else 1
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


# -- tiny Stable Diffusion shared by the image-stage tests -------------------------------------------------------------
@pytest.fixture(scope="module")
def single_thread_torch():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine they oversubscribe badly."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_sd_dir(tmp_path_factory):
    from lance_pipeline.tiny.image_components import create_tiny_stable_diffusion

    return create_tiny_stable_diffusion(tmp_path_factory.mktemp("tiny-sd"))


@pytest.fixture(scope="session")
def tiny_sd(tiny_sd_dir):
    from lance_pipeline.editing.sd_components import load_stable_diffusion_components

    return load_stable_diffusion_components(str(tiny_sd_dir), dtype="float32", device="cpu")


# -- one local build of the demo preset's real tiny stages, the reference of every engine/schedule byte comparison ---
@pytest.fixture(scope="session")
def local_demo(shared_release):
    """``builder_helpers.demo_config()`` built by the local engine, batch-major, once for the session
    (tests/test_scale.py, tests/test_builder_ray.py, tests/test_judge.py compare other engines and schedules to it)."""
    from builder_helpers import demo_config

    return shared_release.of_config("demo-local", demo_config)


# -- preset releases built once per test session, for the tests that only read them ----------------------------------
class SharedReleases:
    """``shared_release("demo")``: the preset built once per test session by ``lance-cf build PRESET --device cpu``,
    whichever worker asks first; a worker asking meanwhile waits at the house lock (``output_lock(..., wait=True)`` on
    the build's own lock folder) and then finds the finished release. ``shared_release.loads("demo")`` gives the model
    loads that build made (tests/load_counter.py). A test must not write into a shared release (it copies it first, as
    the review tests do). That rule is checked: at the end of the session every shared release must still hold the
    bytes it was built with, or the session fails naming the files that changed."""

    def __init__(self, root: Path):
        self.root = root
        self.built: dict[str, dict[str, str]] = {}  # what this process saw when it first took each release

    def __call__(self, preset: str) -> Path:
        from builder_helpers import counting_loads

        def build_preset(folder: Path) -> None:
            counting_loads(self.root / f"{preset}.loads.json", "build", preset, "--output", str(folder),
                           "--no-progress", "--device", "cpu")  # fmt: skip

        return self._once(preset, build_preset)

    def of_config(self, name: str, make_config) -> Path:
        """``make_config()`` (a ``BuildConfig``) built once per session as ``name``, by the local engine in the asking
        process (batch-major, CPU)."""
        from builder.engine import build

        return self._once(name, lambda folder: build(make_config(), folder, device="cpu", progress=False))

    def _once(self, name: str, build_into) -> Path:
        from builder_helpers import release_files

        from builder.release_format.lock import output_lock

        folder = self.root / name
        lock = self.root / ".build-locks" / name
        lock.mkdir(parents=True, exist_ok=True)
        with output_lock(lock, f"test session: shared build of {name}", wait=True):
            if not (folder / "manifest.json").is_file():  # the engine writes the manifest last
                build_into(folder)
            self.built.setdefault(name, release_files(folder))
        return folder

    def loads(self, preset: str) -> dict[str, dict[str, int]]:
        """The model loads of the shared build of ``preset``, per loader and model (tests/load_counter.py)."""
        import json

        self(preset)
        return json.loads((self.root / f"{preset}.loads.json").read_text())

    def check_unchanged(self) -> list[str]:
        """The files, ``NAME/PATH``, of the shared releases this process took whose bytes have changed since."""
        from builder_helpers import release_files

        changed = []
        for preset, files in self.built.items():
            now = release_files(self.root / preset)
            changed += [
                f"{preset}/{name}" for name in sorted(set(files) | set(now)) if files.get(name) != now.get(name)
            ]
        return changed


@pytest.fixture(scope="session")
def shared_release():
    releases = SharedReleases(Path(os.environ["LANCE_CF_TEST_RELEASES"]))
    yield releases
    changed = releases.check_unchanged()
    assert not changed, f"a test wrote into a shared release (copy it first): {', '.join(changed)}"
