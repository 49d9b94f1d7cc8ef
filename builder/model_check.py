"""Before a build's first stage loads: every model it needs is here (or fetched), and a full-size build on the CPU is
said so.

``build_needs`` reads the active stages' declared models (``lance_pipeline.models.needs``) from the validated config,
nothing loaded. ``resolve_models`` checks them against the cache and, for what is missing, the Hub (bounded, in
seconds, before torch is imported): a model that is neither cached nor reachable stops the build with one line per
model and the ``lance-cf models download`` command. ``models_ready`` downloads the reachable ones, under one progress
bar, and when every model is here and the Hub does not answer, lets the stages load offline, so no library waits on
it. ``check_cpu`` refuses
to start a full-size build on the CPU unless ``--device cpu`` asked for it, with an estimate of how long it would
take from the UNet evaluations these options count and a quick measured step of this CPU.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
from collections.abc import Iterator
from typing import Any

from lance_pipeline.models.hub_cache import (
    LOCAL_MARKER,
    ModelState,
    endpoint,
    fetch_models,
    format_size,
    hub_answers,
    hub_offline,
    inspect_models,
)
from lance_pipeline.models.needs import ModelNeed, needs_of
from lance_pipeline.release_kinds import kind_of_manifest, list_kinds, resolve_target

logger = logging.getLogger(__name__)


def build_needs(validated: Any) -> list[ModelNeed]:
    """Every model the active stages of a validated build will load, in stage order."""
    needs: list[ModelNeed] = []
    for stage in validated.active:
        needs += needs_of(stage.cls, stage.options, stage.config.name)
    return needs


# What works without the Hub for a build: said by every offline failure of a build's models.
BUILD_OFFLINE_WAYS = (
    "without the Hub: every key above also takes a local directory (lance-cf models download PRESET --local-dir DIR, "
    "run where the Hub answers, writes copies and a config pointing at them), and the demo presets (demo, "
    "demo-controlnet, demo-instruct, demo-star) build offline on tiny models (noise), with --source imagefolder:PATH for your photos"
)


class ModelsMissing(ValueError):
    """Models that are neither cached nor reachable: one line each, what works without the Hub for this command, and
    the command that fetches them."""

    def __init__(
        self,
        states: list[ModelState],
        command: str | None = None,
        then: str | None = None,
        offline_ways: str | None = None,
    ) -> None:
        self.states = states
        self.command = command
        self.then = then  # the last line instead of the download command (``models download`` itself)
        # What this command can use instead of the Hub (its parser's ``offline_ways`` default); a build's by default
        self.offline_ways = offline_ways
        super().__init__(self._message())

    @property
    def missing(self) -> list[ModelState]:
        return [s for s in self.states if s.problem and not s.stand_in and not s.need.optional]

    def _is_build(self) -> bool:
        return self.command is not None and self.command.split()[3:4] not in [[c] for c in MODEL_COMMANDS]

    def _message(self) -> str:
        missing = self.missing
        reasons = {s.problem for s in missing}
        common = next(iter(reasons)) if len(reasons) == 1 else None
        head = f"{len(missing)} model(s) needed are neither cached nor reachable"
        lines = [head + (f"; {common}:" if common else ":")]
        for state in missing:
            lines.append("  " + missing_line(state) + ("" if common else f": {state.problem}"))
        ways = self.offline_ways or (BUILD_OFFLINE_WAYS if self._is_build() else None)
        if ways:
            lines.append(f"  {ways}")
        if self.then:
            lines.append(f"  {self.then}")
        else:
            command = self.command or "lance-cf models download PRESET_OR_CONFIG"
            lines.append(f"  {'or ' if ways else ''}fetch them where the Hub is reachable: {command}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self._message()


def keys_of(state: ModelState) -> str:
    """The keys that name a model, compact: ``stages[invert,edit].options.model``, ``--model``."""
    keys = list(dict.fromkeys(u.key for u in state.users))
    parsed = [re.fullmatch(r"stages\[([^\]]+)\]\.options\.(.+)", k) for k in keys]
    if len(keys) > 1 and all(parsed) and len({m.group(2) for m in parsed}) == 1:
        return f"stages[{','.join(m.group(1) for m in parsed)}].options.{parsed[0].group(2)}"
    return ", ".join(keys)


def missing_line(state: ModelState) -> str:
    """``ID@REV (SIZE) for KEY``: what is missing, how big, and the key that takes a local directory instead."""
    need = state.need
    if need.repo_id is None:
        return f"local directory {need.local_path} for {keys_of(state)}"
    size = format_size(state.size) if state.size is not None else "size unknown offline"
    return f"{need.label} ({size}) for {keys_of(state)}"


def resolve_models(
    needs: list[ModelNeed], command: str | None = None, offline_ways: str | None = None
) -> list[ModelState]:
    """Where each of ``needs`` stands (cache, Hub), in seconds and without importing torch; raises
    ``ModelsMissing`` when one is neither cached nor reachable, before anything is downloaded or loaded."""
    states = inspect_models(needs, probe="missing") if needs else []
    error = ModelsMissing(states, command, offline_ways=offline_ways)
    if error.missing:
        raise error
    # An optional model that is missing is the command's to report (it says what it skips without it).
    return states


@contextlib.contextmanager
def models_ready(states: list[ModelState], *, progress: bool = True) -> Iterator[None]:
    """Download the reachable models that are not cached, then run the block, offline when the Hub does not answer
    (every model cached, or a packaged stand-in in use)."""
    to_fetch = [s for s in states if not s.cached and s.reachable and not s.stand_in]
    if to_fetch:
        total = sum(s.missing_bytes() for s in to_fetch)
        logger.info(
            "downloading %d model(s) not in the cache (%s) from %s: %s",
            len(to_fetch),
            format_size(total),
            endpoint(),
            ", ".join(s.need.label for s in to_fetch),
        )
        fetch_models(to_fetch, progress=progress)
    uses_hub = any(s.need.repo_id for s in states)
    offline = any(s.stand_in for s in states) or (uses_hub and not to_fetch and not hub_answers())
    if offline:
        logger.info("the Hub does not answer and every model is here: the stages load them offline")
    with hub_offline(offline):
        yield


# Commands that declare the models they load (their parser's ``models`` default), usable as a ``lance-cf models``
# TARGET: evaluation's and each release kind's own (``ReleaseKind.subcommands``).
MODEL_COMMANDS = ("eval", *(c for kind in list_kinds() for c in kind.subcommands), "compare-editors")


# -- CPU honesty --------------------------------------------------------------------------------------------------------
# FLOPs of one Stable Diffusion 1.x/2.x UNet sample-forward at 512 px (a 64x64 latent), counted with torch's FLOP
# counter on the architecture (docs/performance.md; lance_pipeline.editing.cost). It scales with the latent's area.
UNET_FORWARD_FLOPS_512 = 0.803e12


def unet_evaluations(validated: Any) -> dict[str, float]:
    """UNet forward-equivalents per source image, per image stage of the build, from the stages' options: the count
    of the build's release kind (``ReleaseKind.unet_evaluations``, recognised from the config's source and stages as
    the manifest will record it); empty for a kind that declares none."""
    source = validated.config.source
    manifest = {
        "source": {"kind": source.split(":", 1)[0] if isinstance(source, str) else None},
        "config": {"stages": [{"type": s.config.type} for s in validated.stages]},
    }
    kind = kind_of_manifest(manifest)
    if kind.unet_evaluations is None:
        return {}
    stages = [(s.config.name, s.config.type, s.options, s.create) for s in validated.active]
    return resolve_target(kind.unet_evaluations)(stages)


def measure_cpu_flops(threads: int, repeats: int = 2) -> float:
    """This CPU's speed on the UNet's commonest operation, in FLOP/s: a 3x3 convolution of 320 channels on a 64x64
    latent (the first level of a 512 px UNet), the best of a few runs at ``threads`` torch threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        conv = torch.nn.Conv2d(320, 320, 3, padding=1)
        x = torch.randn(1, 320, 64, 64)
        flops = 2 * x.shape[0] * 320 * 320 * 9 * 64 * 64
        best = math.inf
        with torch.inference_mode():
            conv(x)  # warm-up
            for _ in range(repeats):
                start = time.perf_counter()
                conv(x)
                best = min(best, time.perf_counter() - start)
        return flops / best
    finally:
        torch.set_num_threads(before)


def is_full_size(needs: list[ModelNeed]) -> bool:
    """Models that may be large: a Hub id, or a local copy made by ``lance-cf models download --local-dir``."""
    return any(n.repo_id is not None or os.path.isfile(os.path.join(str(n.local_path), LOCAL_MARKER)) for n in needs)


# A build whose estimate on the CPU is under this runs there without --device cpu (a config of tiny local models).
CPU_REFUSAL_SECONDS = 3600


def configured_unet(needs: list[ModelNeed]) -> tuple[str, dict, dict | None] | None:
    """(label, UNet config, VAE config or None) of the first model the build loads that has a UNet, read from its
    local directory or the Hub cache without loading anything; None when no such config is here (a Hub model not
    yet downloaded: the pinned Stable Diffusion's count stands for it)."""
    from huggingface_hub import try_to_load_from_cache

    from lance_pipeline.readers import expect_mapping, read_json

    def read(need: ModelNeed, name: str) -> dict | None:
        if need.local_path is not None:
            path = os.path.join(os.path.expanduser(str(need.local_path)), name)
        else:
            path = try_to_load_from_cache(need.repo_id, name, revision=need.revision, cache_dir=need.cache_dir)
        if not isinstance(path, str) or not os.path.isfile(path):
            return None
        return expect_mapping(read_json(path), path)

    for need in needs:
        if "unet/config.json" not in need.files:
            continue
        unet = read(need, "unet/config.json")
        if unet is not None:
            label = os.path.basename(os.path.normpath(str(need.local_path))) if need.repo_id is None else need.label
            return label, unet, read(need, "vae/config.json")
    return None


def unet_forward_flops(unet_config: dict, vae_config: dict | None, image_size: int) -> float:
    """FLOPs of one sample-forward of the UNet this config describes at ``image_size``, counted with torch's FLOP
    counter on the architecture built on the meta device (no weights, no memory)."""
    import torch
    from diffusers import UNet2DConditionModel
    from torch.utils.flop_counter import FlopCounterMode

    scale = 2 ** (len(vae_config.get("block_out_channels", (0,) * 4)) - 1) if vae_config else 8
    side = max(1, image_size // scale)
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(unet_config)
        sample = torch.zeros(1, unet.config.in_channels, side, side)
        text = torch.zeros(1, 77, int(unet.config.cross_attention_dim))
        step = torch.tensor([10])
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        unet(sample, step, encoder_hidden_states=text)
    return float(counter.get_total_flops())


def format_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def check_cpu(validated: Any, needs: list[ModelNeed], images: int, requested: str | None, threads: int) -> None:
    """Refuse a build that would run on the CPU for more than an hour because no GPU was found (``--device`` not
    given), with an estimate of its duration from the UNet the config names; ``--device cpu`` runs it. Demo builds
    and configs of tiny local models are not concerned."""
    if requested not in (None, "auto") or not is_full_size(needs):
        return
    counts = unet_evaluations(validated)
    per_image = sum(counts.values())
    size = validated.config.image_size or 512
    configured = configured_unet(needs) if per_image else None
    flops, which = UNET_FORWARD_FLOPS_512 * (size / 512) ** 2, "the pinned Stable Diffusion UNet"
    if configured is not None:
        label, unet_config, vae_config = configured
        try:
            flops, which = unet_forward_flops(unet_config, vae_config, size), f"the UNet of {label}"
        except Exception as error:  # noqa: BLE001 - an architecture the counter cannot build: the pinned model's count
            logger.warning("could not count the UNet of %s (%s); estimating with Stable Diffusion's", label, error)
    rate = measure_cpu_flops(threads)
    per_forward = flops / rate
    total = images * per_image * per_forward
    if per_image and total < CPU_REFUSAL_SECONDS:
        logger.info("no GPU found: running on the CPU (estimated %s for %s)", format_duration(total), which)
        return
    if per_image:
        parts = ", ".join(f"{name} {count:,.0f}" for name, count in counts.items())
        estimate = (
            f"{images} image(s) x {per_image:,.0f} UNet evaluations each ({parts}; counted for these options), at "
            f"least {per_forward:.3g} s each on this CPU ({which}: {flops / 1e12:.3g} TFLOP at {size} px; a UNet "
            f"convolution measured here at {rate / 1e9:.0f} GFLOP/s with {threads} thread(s)): at least "
            f"{format_duration(total)}, the text models not counted"
        )
    else:
        estimate = f"its models are full size; one UNet-sized step alone takes {per_forward:.0f} s here"
    raise ValueError(
        f"no GPU found, so this build would run on the CPU: {estimate}. Run it on a machine with a GPU, or pass "
        "--device cpu to run it here anyway"
    )
