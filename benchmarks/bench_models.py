"""How fast a build without its models says so, and how fast ``lance-cf models list`` answers.

Each row runs a real ``lance-cf`` process (its imports included) several times and reports the median wall time:

* ``build lance`` on six photos, ``--device cpu``, no model cached, up to its one error: on this machine's own network
  (whatever it does with huggingface.co), with ``HF_ENDPOINT`` at a local port that refuses connections, and at one
  that accepts them and never answers (the slowest case: the bounded timeouts);
* ``build`` without ``--device`` on a machine without a GPU, of the lance preset with its models as local copies
  (empty stand-in folders marked as ``models download --local-dir`` marks them): the CPU refusal, with its estimate
  (it measures a convolution);
* ``models list lance`` on the same networks and with ``HF_HUB_OFFLINE=1``.

``--baseline REV`` also times ``build lance`` (this machine's network) at an older commit of the repository, checked
out into a temporary directory with ``git archive``, once (it may take minutes), for the before/after figure.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_models.py [--runs 3] [--baseline 12f99c4]
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env(tmp: Path, code: Path, endpoint: str | None = None, offline: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and not k.endswith("_OFFLINE")}
    env.update(
        PYTHONPATH=str(code),
        OMP_NUM_THREADS="1",
        HF_HOME=str(tmp / "hf-home"),  # nothing cached
        LANCE_CF_CACHE=str(tmp / "lance-cache"),
        NO_PROXY="127.0.0.1,localhost",
    )
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def _time(args: list[str], env: dict[str, str], cwd: Path, timeout: float) -> tuple[float, int, str]:
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "builder.cli", *args], env=env, cwd=cwd, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, -1, "(timed out)"
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return time.perf_counter() - start, proc.returncode, lines[0][:110] if lines else ""


def _photos(root: Path) -> Path:
    from PIL import Image

    for label in ("cat", "dog"):
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(3):
            Image.new("RGB", (96, 80), (40 * i, 90, 160)).save(root / label / f"{i}.jpg")
    return root


def _local_copies_config(tmp: Path) -> Path:
    """The lance preset with every model key at a folder that passes for a ``--local-dir`` copy (nothing loads)."""
    import yaml

    from lance_pipeline.models.hub_cache import LOCAL_MARKER

    data = yaml.safe_load((ROOT / "builder" / "presets" / "lance.yaml").read_text())
    for stage in data["stages"]:
        options = stage["options"] = dict(stage["options"])
        for key in ("model", "clip_model"):
            if key in options:
                copy = tmp / "copies" / str(options[key]).replace("/", "--")
                copy.mkdir(parents=True, exist_ok=True)
                (copy / LOCAL_MARKER).write_text("{}")
                options[key] = str(copy)
        if "clip_pretrained" in options:
            options["clip_pretrained"] = None
    path = tmp / "lance-local.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline", metavar="REV", help="also time build lance at this older commit, once")
    parser.add_argument("--baseline-timeout", type=float, default=600.0)
    args = parser.parse_args()

    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    refused_port = refused.getsockname()[1]
    refused.close()  # nothing listens there now
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # accepts (the kernel completes the handshake), never answers
    networks = {
        "this machine's network": None,
        "a port that refuses": f"http://127.0.0.1:{refused_port}",
        "a port that never answers": f"http://127.0.0.1:{silent.getsockname()[1]}",
    }
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        photos = _photos(tmp / "photos")
        build = ["build", "lance", "--source", f"imagefolder:{photos}", "--output", str(tmp / "out"), "--no-progress"]
        rows = []
        for label, endpoint in networks.items():
            rows.append((f"build lance --device cpu, {label}", [*build, "--device", "cpu"], endpoint, False))
        local = ["build", str(_local_copies_config(tmp)), *build[2:]]
        rows.append(("build (lance, local copies) without --device: the CPU refusal", local, None, False))
        for label, endpoint in networks.items():
            rows.append((f"models list lance, {label}", ["models", "list", "lance"], endpoint, False))
        rows.append(("models list lance, HF_HUB_OFFLINE=1", ["models", "list", "lance"], None, True))
        print(f"| command | median s ({args.runs} runs) | min s | exit | first line |")
        print("|---|---|---|---|---|")
        for label, command, endpoint, offline in rows:
            times, code, first = [], None, ""
            for _ in range(args.runs):
                seconds, code, first = _time(command, _env(tmp, ROOT, endpoint, offline), tmp, 120)
                times.append(seconds)
            print(f"| {label} | {statistics.median(times):.2f} | {min(times):.2f} | {code} | {first} |", flush=True)
        if args.baseline:
            base = tmp / "baseline"
            base.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.baseline], capture_output=True, check=True
            )
            subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
            seconds, code, first = _time([*build, "--device", "cpu"], _env(tmp, base), tmp, args.baseline_timeout)
            print(f"| baseline {args.baseline}: build lance --device cpu, this machine's network | {seconds:.1f} | "
                  f"{seconds:.1f} | {code} | {first} |")  # fmt: skip
    silent.close()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
