"""The Ray engine gives the same bytes as the local one, and a missing Ray extra is a one-line install hint."""

from __future__ import annotations

import importlib.util
import json

import pytest
from builder_helpers import ALL_CONFIGS, FAKE_STAGES, REPO, cli, make_imagefolder, release_files, write_config

from builder.config import load_config
from builder.engine import build
from builder.verify import verify_release

pytestmark = pytest.mark.slow  # starts Ray

HAS_RAY = importlib.util.find_spec("ray") is not None


@pytest.mark.skipif(not HAS_RAY, reason="the [ray] extra is not installed")
def test_ray_engine_matches_local_build_byte_for_byte(tmp_path):
    import ray

    src = make_imagefolder(tmp_path / "src", ["a", "b", "c"], per_class=3)
    # Batches of one, and the first sample breaks the caption stage: its batch is deferred until the stage has
    # worked on another batch, then recorded as a failure, on Ray as locally.
    stages = [FAKE_STAGES[0] | {"options": {"fail_keys": ["a_img_000", "b_img_001"]}}, FAKE_STAGES[1]]
    cfg = load_config(
        str(write_config(tmp_path / "c.yaml", f"imagefolder:{src}", stages=stages, configs=ALL_CONFIGS, batch_size=1))
    )
    build(cfg, tmp_path / "local", progress=False)
    # Actors import the stages (tests.fake_stages) from the repository.
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        build(cfg, tmp_path / "ray", progress=False, engine="ray", workers=2)
    finally:
        ray.shutdown()
    assert verify_release(tmp_path / "ray") == []
    manifest = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert [e["source_key"] for e in manifest["build"]["errors"]] == ["a_img_000", "b_img_001"]
    assert release_files(tmp_path / "ray") == release_files(tmp_path / "local")


def test_missing_ray_extra_names_the_install_command(tmp_path):
    src = make_imagefolder(tmp_path / "src", ["a"], per_class=1)
    cfg = write_config(tmp_path / "c.yaml", f"imagefolder:{src}", stages=FAKE_STAGES, configs=ALL_CONFIGS)
    # Hide ray from the subprocess, whether or not it is installed here.
    (tmp_path / "shadow").mkdir()
    (tmp_path / "shadow" / "ray.py").write_text("raise ImportError('No module named ray')\n")
    import os

    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{tmp_path / 'shadow'}{os.pathsep}{env_path}"
    try:
        proc = cli("build", str(cfg), "--output", str(tmp_path / "out"), "--engine", "ray", check=False)
    finally:
        os.environ["PYTHONPATH"] = env_path
    assert proc.returncode == 2
    assert "pip install 'lance-counterfactuals[ray]'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(not HAS_RAY, reason="the [ray] extra is not installed")
def test_ray_with_two_workers_matches_local_on_the_demo_real_tiny_models(tmp_path):
    """The demo preset's real stages (tiny BLIP-2, causal LM, MiniLM, masked LM, Stable Diffusion, CLIP): Ray with
    2 workers writes the same bytes as the local engine, because both run stages with the same torch threads."""
    import os

    import ray

    from builder.config import apply_overrides

    config = apply_overrides(load_config("demo"), limit=3, batch_size=1)  # 3 batches for 2 actors
    build(config, tmp_path / "local", progress=False)
    env_vars = {
        name: os.environ[name]
        for name in ("LANCE_CF_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
        if name in os.environ
    }
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO), **env_vars}})
    try:
        build(config, tmp_path / "ray", progress=False, engine="ray", workers=2)
    finally:
        ray.shutdown()
    assert verify_release(tmp_path / "ray") == []
    manifest = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert manifest["counts"]["counterfactual"]["total"] > 0 and manifest["build"]["torch_threads"] == 1
    assert "scheduler" in manifest["stages"]["invert"]  # described where it ran, with its models loaded
    assert release_files(tmp_path / "ray") == release_files(tmp_path / "local")
