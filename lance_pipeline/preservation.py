"""Preservation: how much of the source image an edit leaves alone, measured the same way for every editor.

A stress-test counterfactual should change one aspect of the scene and keep the rest; editors differ in how much
else they disturb (instruction editors are reported to over-edit). Per counterfactual, against its source image (the
record's ``image``, the ``original`` config's pixels), this module measures:

* ``LPIPS`` (Zhang, Isola, Efros, Shechtman, Wang, CVPR 2018, "The Unreasonable Effectiveness of Deep Features as a
  Perceptual Metric", v0.1): the distance of unit-normalised VGG16 features, weighted per channel by the paper's
  learned linear layers, averaged over space and summed over five layers. The ``lpips`` package supplies the layers
  and the linear weights; those ship as a pickled PyTorch file, so they are converted once to safetensors
  (``lpips_vgg_v0.1_linear.safetensors`` beside this module, :func:`convert_lpips_linear_weights`, read with
  ``torch.load(weights_only=True)``: tensors only) and nothing is unpickled at run time. The VGG16 backbone is
  torchvision's ImageNet weights as timm republished them in safetensors (``timm/vgg16.tv_in1k`` at a pinned
  commit, or a local directory with the same ``model.safetensors``), loaded into the package's network by name.
* ``PSNR`` (dB, peak 255) and ``SSIM`` (Wang, Bovik, Sheikh, Simoncelli, IEEE TIP 2004: Gaussian window sigma 1.5,
  K1 0.01, K2 0.03, population covariance; per RGB channel, averaged) through scikit-image's
  ``peak_signal_noise_ratio`` and ``structural_similarity``.

Each is computed over the whole image and, where an object mask is known (``SOURCE_KEY.png`` in a masks folder,
non-zero = object, resized to the image with nearest neighbours, as ``lance-cf eval --masks`` reads it), over the
pixels outside the object: the MSE of those pixels for PSNR, the mean of SSIM's map over them (the map's 5-pixel
border, which scikit-image leaves out of its mean, left out too), and the mean of LPIPS's spatial map (each layer's
weighted distance upsampled bilinearly to the image, summed over layers) over them.

``PreservationStage`` (``preservation``) runs after the edit stage of any editor: it reads the edit stage's
``counterfactuals`` and adds the six fields to each (``OutputScreen``: it removes nothing), so they reach every
counterfactual's metadata, typed and described; the manifest's ``screening.preservation`` holds their means per
editor and edit type, which the card shows.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lance_pipeline.models.needs import ModelOption
from lance_pipeline.models.shared import shared_model
from lance_pipeline.option_types import Options
from lance_pipeline.stage import SAMPLE_INDEX, MetadataField, OutputScreen, Record, SampleFailure, stage_options

logger = logging.getLogger(__name__)

# torchvision's VGG16 ImageNet weights (the backbone LPIPS-VGG was trained on) as timm republished them in
# safetensors; the commit public projects pin for this repository (not re-checked against the Hub from this offline
# environment).
LPIPS_BACKBONE = "timm/vgg16.tv_in1k"
LPIPS_BACKBONE_REVISION = "b8d8aa2dd860af9233c8c67385a8097fd6c35d3f"
LPIPS_BACKBONE_FILES = ("config.json", "model.safetensors")
LPIPS_VERSION = "0.1"
LPIPS_LINEAR_WEIGHTS = Path(__file__).with_name("lpips_vgg_v0.1_linear.safetensors")
# sha256 of the lpips 0.1.4 package's weights/v0.1/vgg.pth, from which the safetensors file above was converted.
LPIPS_LINEAR_SOURCE_SHA256 = "a78928a0af1e5f0fcb1f3b9e8f8c3a2a5a3de244d830ad5c1feddc79b8432868"
# The lpips package cuts VGG16's ``features`` after each of the five blocks' last ReLU: layers [0, 4), [4, 9), ...
VGG16_SLICES = ((0, 4), (4, 9), (9, 16), (16, 23), (23, 30))
SSIM_SIGMA = 1.5
# scikit-image leaves (win_size - 1) // 2 pixels of SSIM's map out of its mean; win_size = 2 * int(3.5 sigma + 0.5) + 1
SSIM_BORDER = int(3.5 * SSIM_SIGMA + 0.5)

MEASURES = ("lpips", "psnr", "ssim")
# What the manifest records per editor and edit type besides the means: the edits the edit stage was given, those
# its gates kept (a chosen candidate), and their counted cost (``lance_pipeline.editing.cost.count_network_cost``).
ACCOUNTING_KEYS = ("edits", "edits_kept", "forward_equivalents", "flops")
PRESERVATION_FIELDS = (
    MetadataField(
        "preservation_lpips",
        "float64",
        description="LPIPS (VGG, v0.1) between the source image and this counterfactual, whole image (0 = identical)",
        minimum=0.0,
    ),
    MetadataField(
        "preservation_psnr",
        "float64",
        description="PSNR (dB, peak 255) between the source image and this counterfactual, whole image; null where "
        "the two are identical (infinite)",
    ),
    MetadataField(
        "preservation_ssim",
        "float64",
        description="SSIM (Gaussian sigma 1.5, per RGB channel, averaged) between the source image and this "
        "counterfactual, whole image (1 = identical)",
        minimum=-1.0,
        maximum=1.0,
    ),
    MetadataField(
        "preservation_lpips_outside",
        "float64",
        description="LPIPS outside the object (its spatial map averaged over the mask's background); null without "
        "an object mask",
        minimum=0.0,
    ),
    MetadataField(
        "preservation_psnr_outside",
        "float64",
        description="PSNR (dB) over the pixels outside the object; null without an object mask or where they are "
        "identical",
    ),
    MetadataField(
        "preservation_ssim_outside",
        "float64",
        description="SSIM's map averaged over the pixels outside the object; null without an object mask",
        minimum=-1.0,
        maximum=1.0,
    ),
)
FIELD_NAMES = tuple(f.name for f in PRESERVATION_FIELDS)


def field_name(measure: str, outside: bool) -> str:
    """The metadata field of a measure (``lpips``, ``psnr``, ``ssim``), whole image or outside the object."""
    return f"preservation_{measure}{'_outside' if outside else ''}"


# ---------------------------------------------------------------------------------------------- pixel measures


def _pixels(image: Any, size: tuple[int, int] | None = None):
    import numpy as np

    image = image.convert("RGB")
    if size is not None and image.size != size:
        image = image.resize(size, resample=3)
    return np.asarray(image, dtype=np.uint8)


def _background(mask: Any, shape: tuple[int, ...]):
    """The boolean background (mask == 0) of a 2-D mask the image's height x width, or None without a mask."""
    import numpy as np

    if mask is None:
        return None
    mask = np.asarray(mask)
    if mask.shape != tuple(shape[:2]):
        raise ValueError(f"object mask is {mask.shape}, the image is {tuple(shape[:2])} (height, width)")
    return mask == 0


def psnr(original: Any, edited: Any, mask: Any = None) -> float | None:
    """PSNR (dB, peak 255) of two PIL images (the edited one resized to the original's size), whole image or, with
    ``mask`` (non-zero = object), over the pixels outside it. None where the pixels compared are identical (infinite
    PSNR) or there is no background pixel."""
    import numpy as np
    from skimage.metrics import peak_signal_noise_ratio

    a = _pixels(original)
    b = _pixels(edited, original.size)
    background = _background(mask, a.shape)
    if background is None:
        if np.array_equal(a, b):
            return None
        return float(peak_signal_noise_ratio(a, b, data_range=255))
    if not background.any():
        return None
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2)[background].mean())
    return None if mse == 0 else 10.0 * math.log10(255.0**2 / mse)


def ssim(original: Any, edited: Any, mask: Any = None) -> float | None:
    """SSIM of two PIL images (Wang et al. 2004 as scikit-image computes it with ``gaussian_weights``), whole image
    or, with ``mask``, the mean of SSIM's map outside the object. None where no background pixel is left."""
    from skimage.metrics import structural_similarity

    a = _pixels(original)
    b = _pixels(edited, original.size)
    value, full = structural_similarity(
        a,
        b,
        channel_axis=2,
        data_range=255,
        gaussian_weights=True,
        sigma=SSIM_SIGMA,
        use_sample_covariance=False,
        full=True,
    )
    background = _background(mask, a.shape)
    if background is None:
        return float(value)
    p = SSIM_BORDER
    inner = background[p:-p, p:-p]
    if not inner.any():
        return None
    return float(full.mean(axis=2)[p:-p, p:-p][inner].mean())


# ---------------------------------------------------------------------------------------------- LPIPS


def convert_lpips_linear_weights(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Convert the lpips package's pickled linear weights (``weights/v0.1/vgg.pth``) to safetensors.

    The file is read with ``torch.load(weights_only=True)``: PyTorch's restricted unpickler, which builds tensors
    and nothing else. Run once when the package's weights change (the result sits beside this module)."""
    import torch
    from safetensors.torch import save_file

    state = torch.load(source, map_location="cpu", weights_only=True)
    tensors = {name: tensor.contiguous() for name, tensor in sorted(state.items())}
    save_file(tensors, str(target), metadata={"source": "lpips weights/v0.1/vgg.pth", "version": LPIPS_VERSION})
    return Path(target)


def backbone_weights_file(backbone: str, revision: str | None, cache_dir: str | None = None) -> str:
    """The backbone's ``model.safetensors``: in a local directory, or from the Hub at ``revision`` (the cache first)."""
    if os.path.isdir(backbone):
        path = os.path.join(backbone, "model.safetensors")
        if not os.path.isfile(path):
            raise ValueError(
                f"LPIPS backbone {backbone}: no model.safetensors in it; give a directory with VGG16's weights in "
                f"timm's layout (as {LPIPS_BACKBONE} has them)"
            )
        return path
    from huggingface_hub import hf_hub_download

    return hf_hub_download(backbone, "model.safetensors", revision=revision, cache_dir=cache_dir)


def vgg_backbone_state(weights: dict[str, Any]) -> dict[str, Any]:
    """timm's / torchvision's VGG16 ``features.N.*`` tensors, renamed to the lpips package's ``sliceK.N.*``."""
    out = {}
    for name, tensor in weights.items():
        if not name.startswith("features."):
            continue
        index = int(name.split(".")[1])
        block = next((k for k, (lo, hi) in enumerate(VGG16_SLICES, start=1) if lo <= index < hi), None)
        if block is not None:
            out[f"slice{block}.{name[len('features.') :]}"] = tensor
    return out


class Lpips:
    """LPIPS-VGG v0.1 as the lpips package computes it, with its weights read from safetensors only."""

    def __init__(self, backbone: str, revision: str | None, device: str, cache_dir: str | None = None) -> None:
        import lpips
        import torch
        from safetensors.torch import load_file

        self.device = device
        self.backbone = backbone
        self.revision = None if os.path.isdir(backbone) else revision
        weights_path = backbone_weights_file(backbone, self.revision, cache_dir)
        # pretrained=False: the package would unpickle its .pth; pnet_rand=True: torchvision would download the
        # backbone. Both sets of weights are loaded below, from safetensors. Built on the meta device: torchvision
        # would otherwise draw random weights for the whole VGG16, its 102M-parameter classifier included (1.8 s of
        # CPU, measured), only for every one of them to be dropped or overwritten; the storage is allocated empty and
        # each tensor filled below (the scaling layer's two constants from the package's own module).
        with warnings.catch_warnings(), torch.device("meta"):  # torchvision: lpips passes `pretrained=False`
            warnings.filterwarnings("ignore", category=UserWarning, module="torchvision")
            model = lpips.LPIPS(pretrained=False, net="vgg", version=LPIPS_VERSION, pnet_rand=True, verbose=False)
        model = model.to_empty(device="cpu")
        model.scaling_layer.load_state_dict(lpips.ScalingLayer().state_dict())
        linear = load_file(str(LPIPS_LINEAR_WEIGHTS))
        missing, unexpected = model.load_state_dict(linear, strict=False)
        # lin0..lin4 are also registered as lins.0..lins.4 (the same tensors): the file holds the first names
        if unexpected or any(n.startswith("lin") and not n.startswith("lins.") for n in missing):
            raise ValueError(f"{LPIPS_LINEAR_WEIGHTS}: not LPIPS-VGG's linear layers ({unexpected or missing})")
        backbone_state = vgg_backbone_state(load_file(weights_path))
        try:
            model.net.load_state_dict(backbone_state, strict=True)
        except RuntimeError as error:
            raise ValueError(
                f"LPIPS backbone {backbone}: its model.safetensors is not VGG16's features "
                f"({str(error).splitlines()[0][:160]}); give {LPIPS_BACKBONE} or a directory with its weights"
            ) from error
        self.model = model.to(device).eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.weights_file = weights_path
        self._torch = torch

    def describe(self) -> dict[str, Any]:
        return {
            "metric": f"LPIPS-VGG v{LPIPS_VERSION} (lpips package layers)",
            "backbone": self.backbone if self.revision is not None else os.path.basename(self.backbone.rstrip("/")),
            "revision": self.revision,
            "linear_weights": LPIPS_LINEAR_WEIGHTS.name,
            "linear_weights_source_sha256": LPIPS_LINEAR_SOURCE_SHA256,
        }

    def distances(self, pairs: list[tuple[Any, Any]]) -> list[tuple[float, Any]]:
        """(whole-image LPIPS, spatial map H x W as a numpy array) per (original, edited) pair of PIL images.

        The whole-image value is the package's ``LPIPS.forward`` (each layer's weighted distance averaged over its
        own grid, summed); the map is its ``spatial=True`` form (each layer's upsampled to the image, summed)."""
        import lpips
        import numpy as np

        torch = self._torch
        out = []
        for original, edited in pairs:
            a = torch.from_numpy(_pixels(original).copy()).permute(2, 0, 1)[None].float() / 127.5 - 1.0
            b = torch.from_numpy(_pixels(edited, original.size).copy()).permute(2, 0, 1)[None].float() / 127.5 - 1.0
            a, b = a.to(self.device), b.to(self.device)
            with torch.no_grad():
                m = self.model
                features_a, features_b = m.net(m.scaling_layer(a)), m.net(m.scaling_layer(b))
                whole = 0.0
                spatial = torch.zeros(a.shape[2:], device=a.device)
                for k in range(m.L):
                    diff = (lpips.normalize_tensor(features_a[k]) - lpips.normalize_tensor(features_b[k])) ** 2
                    layer = m.lins[k](diff)
                    whole = whole + layer.mean(dim=(2, 3), keepdim=True)
                    spatial = spatial + lpips.upsample(layer, out_HW=a.shape[2:])[0, 0]
            out.append((float(whole.flatten()[0]), np.asarray(spatial.cpu(), dtype=np.float64)))
        return out


def load_lpips(backbone: str, revision: str | None, device: str, cache_dir: str | None = None) -> Lpips:
    """One LPIPS per (backbone, revision, device) in the process (``lance_pipeline.models.shared``)."""
    local = os.path.isdir(backbone)
    key = ("lpips-vgg", os.path.abspath(backbone) if local else backbone, None if local else revision, str(device))
    return shared_model(key, lambda: Lpips(backbone, revision, device, cache_dir))


def load_mask(masks_dir: str | os.PathLike | None, source_key: str, size: tuple[int, int]):
    """The object mask ``SOURCE_KEY.png`` of ``masks_dir`` resized (nearest) to ``size`` (width, height), as a 2-D
    uint8 array (non-zero = object); None without a folder or without that file."""
    if masks_dir is None:
        return None
    path = Path(masks_dir) / f"{source_key}.png"
    if not path.is_file():
        return None
    import numpy as np
    from PIL import Image

    with Image.open(path) as mask:
        return np.asarray(mask.convert("L").resize(size, resample=0))


def measure(pairs: list[tuple[Any, Any, Any]], lpips_model: Lpips | None) -> list[dict[str, float | None]]:
    """The six preservation fields of each (original, edited, mask or None) triple; LPIPS fields None without a
    model."""
    import numpy as np

    distances = lpips_model.distances([(o, e) for o, e, _ in pairs]) if lpips_model is not None else None
    out = []
    for index, (original, edited, mask) in enumerate(pairs):
        values: dict[str, float | None] = dict.fromkeys(FIELD_NAMES)
        values["preservation_psnr"] = psnr(original, edited)
        values["preservation_ssim"] = ssim(original, edited)
        if mask is not None:
            values["preservation_psnr_outside"] = psnr(original, edited, mask)
            values["preservation_ssim_outside"] = ssim(original, edited, mask)
        if distances is not None:
            whole, spatial = distances[index]
            values["preservation_lpips"] = max(whole, 0.0)
            if mask is not None:
                background = _background(mask, spatial.shape)
                values["preservation_lpips_outside"] = (
                    max(float(np.mean(spatial[background])), 0.0) if background.any() else None
                )
        out.append({k: (round(v, 6) if isinstance(v, float) else v) for k, v in values.items()})
    return out


# ---------------------------------------------------------------------------------------------- the stage


@dataclass
class PreservationOptions(Options):
    """Options of the preservation stage.

    Attributes:
        lpips_backbone, revision: LPIPS's VGG16 backbone (a Hub id at a pinned revision, or a local directory with
            its ``model.safetensors`` in timm's layout).
        masks: a folder of ``SOURCE_KEY.png`` object masks (non-zero = object, in the released image's geometry) for
            the outside-the-object fields; null: those fields are null.
        cache_dir: Hugging Face cache directory (default: the library's).
    """

    lpips_backbone: str = LPIPS_BACKBONE
    revision: str | None = LPIPS_BACKBONE_REVISION
    masks: str | None = None
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.masks is not None and not os.path.isdir(self.masks):
            raise ValueError(
                f"preservation: masks {self.masks!r} is not a directory; give the folder of SOURCE_KEY.png object "
                "masks, or leave masks out"
            )


class PreservationStage:
    """``preservation``: LPIPS, PSNR and SSIM of every counterfactual against its source image, whole and outside
    the object, added to its metadata. Runs after any editor's edit stage; removes nothing."""

    name = "preservation"
    version = "1"
    field = "counterfactuals"
    consumes = {
        "key": "str",
        "image": "image",
        "counterfactuals": "list",
        "edit_candidates": "list",
        "edit_cost": "dict",
    }
    produces = {"counterfactuals": "list", "edit_accounting": "dict"}
    screens = (OutputScreen("counterfactuals", PRESERVATION_FIELDS),)
    options_class = PreservationOptions
    model_options = (
        ModelOption(
            "lpips_backbone",
            LPIPS_BACKBONE_FILES,
            ("model.safetensors",),
            cache_dir="cache_dir",
            role="LPIPS's VGG16 backbone",
        ),
    )

    def __init__(self, options: PreservationOptions | None = None, /, **values: Any) -> None:
        self.options = stage_options(type(self), options, values)
        self.lpips: Lpips | None = None

    def load(self, device: str) -> None:
        o = self.options
        self.lpips = load_lpips(o.lpips_backbone, o.revision, device, o.cache_dir)

    def describe(self) -> dict[str, Any]:
        o = self.options
        return {
            "lpips": self.lpips.describe() if self.lpips is not None else {"backbone": o.lpips_backbone},
            "psnr": "scikit-image peak_signal_noise_ratio, data_range 255",
            "ssim": f"scikit-image structural_similarity, gaussian_weights, sigma {SSIM_SIGMA}, population covariance, "
            "per RGB channel",
            "masks": o.masks is not None,
            "fields": list(FIELD_NAMES),
        }

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        if self.lpips is None:
            raise RuntimeError(f"{type(self).__name__}.load(device) must be called before process()")
        out: list[Record | SampleFailure] = []
        for record in records:
            items = record.get(self.field) or []
            original = record["image"]
            mask = load_mask(self.options.masks, record["key"], original.size)
            values = measure([(original, item["image"], mask) for item in items], self.lpips)
            out.append(
                {
                    self.field: [
                        {**item, **v, SAMPLE_INDEX: item.get(SAMPLE_INDEX, i)}
                        for i, (item, v) in enumerate(zip(items, values, strict=True))
                    ],
                    "edit_accounting": edit_accounting(record.get("edit_candidates"), record.get("edit_cost"), items),
                }
            )
        return out

    @classmethod
    def summarize(cls, updates: list[dict[str, Any]]) -> dict[str, Any]:
        """The manifest's record, per editor and edit type (``all`` too): the number of counterfactuals measured
        (``n``) and the mean of each field, and the edits given to the editor, those its gates kept and their counted
        cost (``ACCOUNTING_KEYS``; a record's cost split evenly over its edits)."""
        groups: dict[tuple[str, str], list[dict]] = {}
        accounts: dict[tuple[str, str], dict[str, float]] = {}
        for update in updates:
            for item in update.get(cls.field) or []:
                editor = str(item.get("editor") or "unknown")
                groups.setdefault((editor, str(item.get("edit_type") or "none")), []).append(item)
                groups.setdefault((editor, "all"), []).append(item)
            account = update.get("edit_accounting") or {}
            for edit_type, counts in (account.get("by_edit_type") or {}).items():
                for group in ((account["editor"], edit_type), (account["editor"], "all")):
                    slot = accounts.setdefault(group, {**dict.fromkeys(ACCOUNTING_KEYS, 0), "uncounted": 0})
                    for name in ACCOUNTING_KEYS:
                        slot[name] += counts.get(name) or 0
                    # an edit stage that recorded no cost (a build directory of an earlier version, resumed)
                    slot["uncounted"] += 0 if account.get("counted") else 1
        by_editor: dict[str, dict[str, Any]] = {}
        for editor, edit_type in sorted(set(groups) | set(accounts)):
            items = groups.get((editor, edit_type), [])
            entry: dict[str, Any] = {"n": len(items)}
            for name in FIELD_NAMES:
                values = [i[name] for i in items if isinstance(i.get(name), (int, float))]
                entry[name] = round(sum(values) / len(values), 6) if values else None
            account = accounts.get((editor, edit_type))
            for name in ACCOUNTING_KEYS:
                entry[name] = None if account is None else round(account[name], 3)
            if account is not None and account["uncounted"]:  # a cost that was not counted for every record is none
                entry["forward_equivalents"] = entry["flops"] = None
            by_editor.setdefault(editor, {})[edit_type] = entry
        measured = sum(g.get("all", {}).get("n", 0) for g in by_editor.values())
        return {"kind": "preservation", "measured": measured, "by_editor": by_editor}


def edit_accounting(
    candidates: list[dict] | None, cost: dict[str, Any] | None, items: list[dict] | None = None
) -> dict[str, Any]:
    """Per edit type of one record: the edits the edit stage was given (its candidate records' ``edit_index``), those
    with a chosen candidate (kept by the gates), and the record's counted cost (render and gates, plus the inversion
    where the editor consumed one) split evenly over its edits. The editor is the one the cost names, else the one its
    counterfactuals name (``items``)."""
    cost = cost or {}
    edits: dict[int, tuple[str, bool]] = {}
    for candidate in candidates or []:
        index = int(candidate.get("edit_index", -1))
        edit_type = str(candidate.get("edit_type") or "none")
        kept = bool(candidate.get("chosen")) or edits.get(index, ("", False))[1]
        edits[index] = (edit_type, kept)
    parts = [p for p in (cost.get("edit"), cost.get("inversion")) if isinstance(p, dict)]
    forward_equivalents = sum(float(p.get("forward_equivalents") or 0) for p in parts)
    flops = sum(float(p.get("flops") or 0) for p in parts)
    share = 1 / len(edits) if edits else 0.0
    by_type: dict[str, dict[str, float]] = {}
    for edit_type, kept in edits.values():
        slot = by_type.setdefault(edit_type, dict.fromkeys(ACCOUNTING_KEYS, 0))
        slot["edits"] += 1
        slot["edits_kept"] += int(kept)
        slot["forward_equivalents"] += forward_equivalents * share
        slot["flops"] += flops * share
    editor = cost.get("editor") or next((i.get("editor") for i in items or [] if i.get("editor")), None)
    return {"editor": str(editor or "unknown"), "counted": bool(parts), "by_edit_type": by_type}
