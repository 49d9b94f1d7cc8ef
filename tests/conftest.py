"""Test-wide settings: everything offline, caches inside the test session's temporary directory."""

from __future__ import annotations

import os

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
def local_demo(tmp_path_factory):
    """``builder_helpers.demo_config()`` built by the local engine, batch-major (tests/test_scale.py,
    tests/test_builder_ray.py, tests/test_builder_schedule.py compare other engines and schedules to it)."""
    from builder_helpers import demo_config

    from builder.engine import build

    out = tmp_path_factory.mktemp("demo-local") / "release"
    build(demo_config(), out, device="cpu", progress=False)
    return out
