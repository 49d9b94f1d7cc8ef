"""A newcomer's first steps, literally: the README's "Set up and run" commands in a fresh copy of the repository, and
every ``next:`` command the tool prints on the way."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from builder_helpers import REPO, readme_blocks
from hub_double import TOKEN

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def fresh_copy(root: Path) -> Path:
    """The repository's tracked files, as a fresh clone has them (nothing built, nothing cached)."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files")
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    for name in listed.decode().split("\0"):
        if name and (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    return root


def push_timm_weights(hub, name: str, tmp: Path) -> None:
    """Random weights of timm model ``name`` as its Hub repo (``timm/NAME``) on the double: what eval downloads."""
    import timm
    from huggingface_hub import HfApi, constants
    from safetensors.torch import save_file

    repo = timm.models.get_pretrained_cfg(name).hf_hub_id
    folder = tmp / "weights" / name
    folder.mkdir(parents=True)
    model = timm.create_model(name, pretrained=False)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    before = constants.HF_HUB_DISABLE_XET, constants.HF_HUB_OFFLINE
    constants.HF_HUB_DISABLE_XET, constants.HF_HUB_OFFLINE = True, False
    try:
        api = HfApi(endpoint=hub.url, token=TOKEN)
        api.create_repo(repo, exist_ok=True)
        api.upload_folder(folder_path=folder, repo_id=repo)
    finally:
        constants.HF_HUB_DISABLE_XET, constants.HF_HUB_OFFLINE = before


def test_the_readme_first_steps_and_every_next_command_run(tmp_path, hub):
    clone = fresh_copy(tmp_path / "lance-counterfactuals")
    # `make setup` creates .venv and installs the package (minutes, and the network): the environment this suite
    # runs in stands for it; the fresh copy's code is what runs (PYTHONPATH).
    (clone / ".venv").symlink_to(Path(sys.prefix))
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(
        PATH=f"{clone / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=str(clone),
        OMP_NUM_THREADS="1",
        LANCE_CF_CACHE=str(tmp_path / "lance-cache"),
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_OFFLINE="1",
        NO_PROXY="127.0.0.1,localhost",
    )

    def run(command: str, **extra: str) -> str:
        proc = subprocess.run(command, shell=True, cwd=clone, env={**env, **extra}, capture_output=True, text=True)
        assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout + proc.stderr

    setup, after_demo = readme_blocks("Set up and run")
    assert setup[:2] == ["make setup", "make demo"], setup
    printed = run("make -o .venv/.installed demo")  # `make demo` with setup done
    assert "verify: OK demo-release" in printed
    for command in after_demo:
        run(command)
    next_commands = []
    lines = printed.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "next:":
            next_commands += [ln.strip() for ln in lines[i + 1 :] if ln.startswith("  ")]
        elif line.strip().startswith("next: "):
            next_commands.append(line.strip()[len("next: ") :])
    assert next_commands, printed

    for command in next_commands:
        words = shlex.split(command)
        online = {}
        if words[:2] == ["lance-cf", "eval"]:  # its classifier's weights come from the Hub: the double has them
            for i, word in enumerate(words):
                if word == "--model" and not words[i + 1].startswith("open_clip:"):  # zero-shot: --no-pretrained
                    push_timm_weights(hub, words[i + 1], tmp_path)
            online = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1"}
        run(command, **online)


def test_the_readme_offline_path_runs_offline_to_a_scored_model(tmp_path):
    """The README's "Without the Hub" commands, literally, with the Hub switched off and nothing cached: a release of
    one's photos (a copy of the demo's), a noise release of them, and a model scored on it, from a folder."""
    (commands,) = readme_blocks("Without the Hub (offline)")
    assert commands[0].startswith("cp -r builder/demo_images photos")
    work = tmp_path / "work"
    shutil.copytree(REPO / "builder" / "demo_images", work / "builder" / "demo_images")
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        LANCE_CF_CACHE=str(tmp_path / "lance-cache"),
        HF_HOME=str(tmp_path / "hf-home"),  # nothing cached
        HF_HUB_OFFLINE="1",
    )
    for command in commands:
        proc = subprocess.run(command, shell=True, cwd=work, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr}"
    scored = sorted(p.parent.name for p in (work / "eval-offline").rglob("results.json"))
    assert len(scored) == 2 and scored[0].startswith("local-dir--my-model__sha-") and scored[1] == "resnet18__random"
    for path in (work / "eval-offline").rglob("*.json"):
        assert str(work) not in path.read_text(), path  # a model folder is named, never its path
    assert (work / "out" / "photos-noise" / "manifest.json").is_file()
