"""Which torch device a command runs on (one rule for ``build``, ``eval`` and every other subcommand), and giving a
device's memory back once a model is dropped.

Import-light (torch is imported inside the functions), so command-line parsing never pays for it.
"""

from __future__ import annotations

import gc


def resolve_device(device: str | None) -> str:
    """A checked torch device name. ``None`` or ``"auto"``: ``cuda`` when a GPU is visible, else ``cpu``.

    An explicit device that this machine does not have (``cuda`` without a GPU, ``cuda:3`` on a 2-GPU machine,
    ``mps`` off Apple silicon, a misspelling) raises ``ValueError`` with one line saying what is there, so a command
    stops before it writes anything.
    """
    import torch

    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"--device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1, auto): {err}") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {device}: no CUDA GPU is visible on this machine; use --device cpu (or auto)")
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"--device {device}: this machine has {count} CUDA GPU(s) (cuda:0..cuda:{count - 1})")
    elif parsed.type == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise ValueError(f"--device {device}: MPS is not available on this machine; use --device cpu (or auto)")
    elif parsed.type != "cpu":
        raise ValueError(f"--device {device}: expected cpu, cuda[:N], mps or auto")
    return str(parsed)


def free_accelerator_memory(*, worker_process: bool = False) -> None:
    """Collect the cyclic garbage a dropped model leaves (so its memory is free before the next model loads) and give
    the CUDA cache back.

    A full collection walks every live object: with torch, transformers and diffusers imported that is about 600,000
    objects and 0.6 s on the 2-core machine, once per stage and worker. ``worker_process``: the caller is a process
    that only serves stages (a ``devices`` worker or a Ray actor) and holds no model now, so what survives this
    collection is the libraries and the worker itself, which live as long as the process; they are moved out of the
    collector's sight (``gc.freeze``), and each later collection walks only what was made since (the next stage's
    models), not the libraries again. Never used in a process that runs other code (the CLI driver, a notebook):
    there a frozen object that dies later would never be collected.
    """
    gc.collect()
    if worker_process:
        gc.freeze()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
