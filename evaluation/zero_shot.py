"""Zero-shot CLIP classifiers for ``lance-cf eval``: an open_clip model turned into an ordinary logits module.

CLIP (Radford et al., ICML 2021, section 3.1.4) classifies without training by scoring an image embedding against one
text embedding per class: the class name is put into each prompt template ("a photo of a {}."), the templates'
normalised text embeddings are averaged and normalised again, and the logits are ``logit_scale * cos``. This module
builds that classifier with open_clip (Cherti et al., CVPR 2023) and wraps it as a ``torch.nn.Module`` with a timm-style
``pretrained_cfg`` (its own resize, crop, mean and std), so that the evaluation harness scores it exactly like a timm
model: every metric, breakdown, interval, plot and report follows the same path.

Model references (``--model``):

* ``open_clip:ARCH/PRETRAINED`` (a built-in architecture and tag, e.g. ``open_clip:ViT-B-32/laion2b_s34b_b79k``);
* ``open_clip:hf-hub:ORG/NAME`` (an open_clip export on the Hub);
* ``open_clip:DIR`` (a local directory with ``open_clip_config.json`` and safetensors weights).

All three load through ``lance_pipeline.clip.loader`` (the project's one CLIP loader). ``--no-pretrained`` builds
``ARCH`` with random weights (seeded) for offline runs and tests.

Template sets (``--templates``): ``openai`` is the 80 prompts of OpenAI's ImageNet evaluation
(``open_clip.zero_shot_metadata.OPENAI_IMAGENET_TEMPLATES``, the set CNS-Bench and ObjectCompose use), ``simple`` is
``"a photo of a {}."``, anything else is a file with one template a line (``{}`` or CLIP_benchmark's ``{c}`` marks
the class name). Class names: for an ImageNet-1k label space, the names CLIP evaluations use
(``open_clip.zero_shot_metadata.IMAGENET_CLASSNAMES``, the list OpenAI published with CLIP's prompt-engineering
notebook; WordNet's first lemmas are ambiguous, e.g. two "crane"s); otherwise the release's own label names.

The text-side classifier is computed once per (text tower weights, templates, class names) and cached by content in
``$LANCE_CF_CACHE/zero-shot/<sha256>.safetensors``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lance_pipeline.clip.loader import ClipModelRef
from lance_pipeline.models.hub_cache import lance_cache_dir
from lance_pipeline.readers import read_text

logger = logging.getLogger(__name__)

PREFIX = "open_clip:"
SIMPLE_TEMPLATE = "a photo of a {}."
BUILTIN_TEMPLATE_SETS = ("openai", "simple")
DEFAULT_TEMPLATES = "openai"
IMAGENET_CLASSNAMES_SOURCE = "open_clip.zero_shot_metadata.IMAGENET_CLASSNAMES"
# open_clip's resize modes -> timm's eval crop modes (timm.data.transforms_factory.transforms_imagenet_eval)
_CROP_MODES = {"shortest": "center", "squash": "squash", "longest": "border"}


def is_zero_shot(name: str) -> bool:
    return name.startswith(PREFIX)


@dataclass(frozen=True)
class TemplateSet:
    """A named list of prompt templates; ``{}`` marks the class name. ``digest`` identifies the exact list."""

    name: str
    templates: tuple[str, ...]

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(json.dumps(list(self.templates)).encode()).hexdigest()

    @property
    def slug(self) -> str:
        return self.name if self.name in BUILTIN_TEMPLATE_SETS else f"{self.name}-{self.digest[7:15]}"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "digest": self.digest, "count": len(self.templates)}


def load_template_set(spec: str) -> TemplateSet:
    """``openai``, ``simple`` or a text file of templates (one a line, ``{}`` or ``{c}`` for the class name)."""
    if spec == "openai":
        from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES

        return TemplateSet("openai", tuple(t("{}") for t in OPENAI_IMAGENET_TEMPLATES))
    if spec == "simple":
        return TemplateSet("simple", (SIMPLE_TEMPLATE,))
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(
            f"--templates {spec!r} is neither a template set (openai, simple) nor a file; give one of those or a "
            "text file with one template a line ({} or {c} marks the class name)"
        )
    where = f"template file {spec!r}"
    lines = [ln.strip() for ln in read_text(path, what=where).splitlines()]
    templates = tuple(ln.replace("{c}", "{}") for ln in lines if ln and not ln.startswith("#"))
    if not templates:
        raise ValueError(f"{where} holds no template; write one a line, with {{}} where the class name goes")
    for template in templates:
        if template.count("{}") != 1 or template.replace("{}", "").count("{") or template.count("}") != 1:
            raise ValueError(f"{where}: {template!r} must contain the class-name marker {{}} (or {{c}}) exactly once")
    return TemplateSet(path.stem, templates)


def class_names_for(label_names: list[str], label_space: str | None) -> tuple[list[str], str]:
    """The class names the prompts use, and where they come from."""
    if label_space == "imagenet-1k" and len(label_names) == 1000:
        from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

        return list(IMAGENET_CLASSNAMES), IMAGENET_CLASSNAMES_SOURCE
    if not label_names:
        raise ValueError("the release manifest names no classes (label_space.names); a zero-shot model needs them")
    return list(label_names), "release label_space.names"


def parse_reference(name: str) -> tuple[str, str | None]:
    """``open_clip:...`` -> (model, pretrained tag or None) for ``ClipModelRef``."""
    ref = name[len(PREFIX) :]
    if not ref:
        raise ValueError(
            f"--model {name!r}: expected open_clip:ARCH/PRETRAINED, open_clip:hf-hub:ORG/NAME or open_clip:DIR"
        )
    if ref.startswith("hf-hub:") or ref.startswith("local-dir:") or os.path.isdir(os.path.expanduser(ref)):
        return os.path.expanduser(ref) if not ref.startswith("hf-hub:") else ref, None
    arch, sep, tag = ref.rpartition("/")
    if not sep or not arch or not tag:
        raise ValueError(
            f"--model {name!r}: expected open_clip:ARCH/PRETRAINED (e.g. open_clip:ViT-B-32/openai), "
            "open_clip:hf-hub:ORG/NAME or an existing directory open_clip:DIR"
        )
    return arch, tag


def display_name(name: str) -> str:
    """The name results record: a local directory is reduced to its last component (no machine path is published)."""
    model, tag = parse_reference(name)
    if tag is None and not model.startswith("hf-hub:"):
        return f"{PREFIX}local-dir:{Path(model.removeprefix('local-dir:')).name}"
    return name


def _module_class():
    import torch
    import torch.nn.functional as F

    class _ZeroShotClassifier(torch.nn.Module):
        """Image tower + fixed text classifier: ``forward(images) -> logits`` over the release's classes."""

        def __init__(self, visual, classifier, logit_scale: float, logit_bias: float | None, pretrained_cfg, info):
            super().__init__()
            self.visual = visual
            self.register_buffer("classifier", classifier)  # [embed_dim, num_classes], unit columns
            self.logit_scale = float(logit_scale)
            self.logit_bias = None if logit_bias is None else float(logit_bias)
            self.num_classes = int(classifier.shape[1])
            self.pretrained_cfg = pretrained_cfg  # read by timm.data.resolve_data_config
            self.zero_shot_info = info

        def forward(self, images):
            features = F.normalize(self.visual(images), dim=-1)
            logits = self.logit_scale * features @ self.classifier.to(features.dtype)
            return logits if self.logit_bias is None else logits + self.logit_bias

    return _ZeroShotClassifier


def _load_clip(name: str, pretrained: bool, seed: int):
    """(open_clip model, preprocess cfg, tokenizer, description) through the project's CLIP loader."""
    import open_clip
    import torch

    model_ref, tag = parse_reference(name)
    if not pretrained:
        if tag is None:
            raise ValueError(
                f"--no-pretrained applies to open_clip:ARCH/PRETRAINED; {name!r} carries its own weights (leave out "
                "--no-pretrained)"
            )
        arch = ClipModelRef._check_builtin(model_ref, tag)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = open_clip.create_model(arch, pretrained=None)
        description = {"model": arch, "source": "random", "pretrained": None, "seed": seed,
                       "open_clip": open_clip.__version__}  # fmt: skip
        return model.eval(), open_clip.get_tokenizer(arch), description
    ref = ClipModelRef(model_ref, tag)
    loaded = ref.load("cpu")
    return loaded.model, loaded.tokenizer, ref.describe(loaded)


def _state_digest(state: dict) -> str:
    import torch

    digest = hashlib.sha256()
    for key, tensor in sorted(state.items()):
        digest.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def cache_dir() -> Path:
    return lance_cache_dir() / "zero-shot"


def text_classifier(model, tokenizer, class_names: list[str], templates: TemplateSet, text_digest: str):
    """``[embed_dim, num_classes]`` zero-shot weights (open_clip's ``build_zero_shot_classifier``), cached by content."""
    import open_clip
    import torch
    from safetensors.torch import load_file, save_file

    prefix = _is_causal_clip(model)
    inputs = {"text_weights": text_digest, "templates": list(templates.templates), "classes": class_names}
    if prefix:  # its features differ from the padded ones by rounding: never mixed with them in the cache
        inputs["text_tokens"] = "up to end-of-text"
    key = hashlib.sha256(json.dumps(inputs).encode()).hexdigest()
    path = cache_dir() / f"{key}.safetensors"
    if path.is_file():
        try:
            logger.info("zero-shot classifier from cache %s", path)
            return load_file(str(path))["classifier"], key, True
        except Exception as error:  # noqa: BLE001 - a damaged cache entry is recomputed
            logger.warning("zero-shot cache %s unreadable (%s); recomputing", path, error)
    encoder, tokenize = model, tokenizer
    if prefix:  # no padding after the end-of-text tokens: the same features up to rounding
        encoder, tokenize = _PrefixTextEncoder(model), _prefix_tokenizer(tokenizer)
    with torch.inference_mode():
        weights = (
            open_clip.build_zero_shot_classifier(
                encoder, tokenize, class_names, list(templates.templates), num_classes_per_batch=10, device="cpu"
            )
            .float()
            .contiguous()
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({"classifier": weights}, str(tmp))
    tmp.replace(path)
    return weights, key, False


def _is_causal_clip(model) -> bool:
    """Whether ``model`` encodes text as open_clip's ``CLIP`` does: a causal (lower-triangular) attention mask and the
    feature of the end-of-text token (the highest id, ``argmax`` pooling). Then a prompt's feature depends only on its
    tokens up to its end-of-text token, and the padding after it can be left out (``_PrefixTextEncoder``)."""
    import open_clip
    import torch

    if type(model).encode_text is not open_clip.model.CLIP.encode_text or model.text_pool_type != "argmax":
        return False
    mask = getattr(model, "attn_mask", None)
    if mask is None or mask.dim() != 2:
        return False
    causal = torch.full(mask.shape, float("-inf"), dtype=mask.dtype, device=mask.device).triu_(1)
    return bool(torch.equal(mask, causal))


def _prefix_tokenizer(tokenizer):
    """The tokenizer's ids cut after the batch's last end-of-text token (``argmax``: the highest id in a row)."""

    def tokenize(texts):
        ids = tokenizer(texts)
        return ids[:, : int(ids.argmax(dim=-1).max()) + 1]

    return tokenize


class _PrefixTextEncoder:
    """``encode_text`` of an open_clip ``CLIP`` (``_is_causal_clip``) on ids cut after the end-of-text token.

    The prompts are padded to the context length (77 tokens for CLIP), but with a causal mask no position attends to a
    later one, and the pooled feature is the end-of-text token's: the padding changes nothing the classifier reads.
    Encoding only the batch's longest prompt (about a dozen tokens for ``"a photo of a {}."``) does the same
    arithmetic on about a sixth of the positions; the features differ from the padded ones only by float rounding
    (the attention's sums run over fewer masked positions), by about 1e-7."""

    def __init__(self, model):
        self.model = model

    def encode_text(self, text, normalize: bool = False):
        import open_clip
        import torch
        import torch.nn.functional as F

        model, n = self.model, text.shape[1]
        cast_dtype = model.transformer.get_cast_dtype()
        x = model.token_embedding(text).to(cast_dtype) + model.positional_embedding[:n].to(cast_dtype)
        x = model.ln_final(model.transformer(x, attn_mask=model.attn_mask[:n, :n]))
        x = open_clip.transformer.text_global_pool(x, text, model.text_pool_type)
        if model.text_projection is not None:
            x = (
                model.text_projection(x)
                if isinstance(model.text_projection, torch.nn.Linear)
                else x @ model.text_projection
            )
        return F.normalize(x, dim=-1) if normalize else x


def _text_weights_digest(model) -> str:
    """Digest of everything but the image tower: the text side the classifier depends on."""
    return _state_digest({k: v for k, v in model.state_dict().items() if not k.startswith("visual.")})


def create_zero_shot_model(
    name: str,
    templates: TemplateSet,
    label_names: list[str],
    label_space: str | None,
    pretrained: bool = True,
    seed: int = 0,
):
    """Build the zero-shot classifier module for ``name`` over the release's classes, in eval mode."""
    clip, tokenizer, description = _load_clip(name, pretrained, seed)
    class_names, names_source = class_names_for(label_names, label_space)
    weights, key, cached = text_classifier(clip, tokenizer, class_names, templates, _text_weights_digest(clip))
    pp = getattr(clip.visual, "preprocess_cfg", None) or {}
    size = pp.get("size") or clip.visual.image_size
    size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
    resize_mode = pp.get("resize_mode", "shortest")
    if resize_mode not in _CROP_MODES:
        raise ValueError(f"{name}: open_clip resize mode {resize_mode!r} has no timm equivalent")
    pretrained_cfg = {
        "input_size": (3, *size),
        "mean": tuple(pp.get("mean", (0.48145466, 0.4578275, 0.40821073))),
        "std": tuple(pp.get("std", (0.26862954, 0.26130258, 0.27577711))),
        "interpolation": pp.get("interpolation", "bicubic"),
        "crop_pct": 1.0,  # open_clip resizes to the input size and centre-crops: no extra border
        "crop_mode": _CROP_MODES[resize_mode],
    }
    info = {
        "clip": description,
        "templates": templates.describe(),
        "class_names": {
            "source": names_source,
            "digest": "sha256:" + hashlib.sha256(json.dumps(class_names).encode()).hexdigest(),
        },
        "classifier_sha256": key,
    }
    bias = getattr(clip, "logit_bias", None)
    module = _module_class()(
        clip.visual,
        weights,
        float(clip.logit_scale.exp().item()),
        None if bias is None else float(bias.item()),
        pretrained_cfg,
        info,
    )
    return module.eval()


# --------------------------------------------------------------------------- template sensitivity (the leaderboard's)
SENSITIVITY_COLUMNS = [
    "model",
    "weights",
    "templates_a",
    "templates_b",
    "original_top1_a",
    "original_top1_b",
    "delta_original_top1",
    "delta_original_top1_ci_low",
    "delta_original_top1_ci_high",
    "paired_top1_diff_a",
    "paired_top1_diff_b",
    "delta_paired_top1_diff",
    "delta_paired_top1_diff_ci_low",
    "delta_paired_top1_diff_ci_high",
    "n_sources",
    "n_pairs",
]


def _per_source(predictions: Any, configs: tuple[str, ...]) -> dict[str, tuple[int, int, int]]:
    """``{source_key: (original correct, pairs, sum of (counterfactual correct - original correct))}``."""
    originals = predictions[predictions["config"] == "original"]
    orig = dict(zip(originals["source_key"], originals["correct1"].astype(int), strict=True))
    edits = predictions[predictions["config"].isin(configs)]
    out: dict[str, list[int]] = {}
    for source, correct in zip(edits["source_key"], edits["correct1"].astype(int), strict=True):
        if source in orig:
            entry = out.setdefault(source, [orig[source], 0, 0])
            entry[1] += 1
            entry[2] += correct - orig[source]
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}


def template_sensitivity(results: list[dict[str, Any]], n_boot: int = 1000, seed: int = 0) -> list[dict[str, Any]]:
    """For every zero-shot model scored with two or more template sets on the release: per pair of sets (A, B), the
    change of original acc@1 and of the paired counterfactual drop (paired Δacc@1 on the ``counterfactual`` config)
    from A to B, in points, with 95% intervals of a paired bootstrap over source images (both sets resampled
    together: the same images, only the prompts differ). Reads each result's ``predictions.parquet``."""
    import itertools

    import numpy as np
    import pandas as pd

    from evaluation.results import is_complete, template_set

    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        if r.get("status") == "ok" and template_set(r) and is_complete(r) and r.get("_path"):
            model = r.get("model") or {}
            groups.setdefault((model.get("name"), (model.get("weights") or {}).get("id")), []).append(r)
    rows = []
    for (name, weights), group in groups.items():
        group = sorted(group, key=lambda r: template_set(r)[0])
        for a, b in itertools.combinations(group, 2):
            if template_set(a)[1] == template_set(b)[1]:
                continue
            per = [
                _per_source(pd.read_parquet(Path(r["_path"]).with_name("predictions.parquet")), ("counterfactual",))
                for r in (a, b)
            ]
            sources = sorted(set(per[0]) & set(per[1]))
            if not sources:
                continue
            arr = np.array([[*per[0][s], *per[1][s]] for s in sources], dtype=float)  # oA nA dA oB nB dB

            def stats(w: Any, arr: Any = arr) -> tuple[Any, Any, Any, Any]:
                total = w.sum(-1)
                acc_a, acc_b = (w @ arr[:, 0]) / total * 100, (w @ arr[:, 3]) / total * 100
                drop_a, drop_b = (w @ arr[:, 2]) / (w @ arr[:, 1]) * 100, (w @ arr[:, 5]) / (w @ arr[:, 4]) * 100
                return acc_a, acc_b, drop_a, drop_b

            acc_a, acc_b, drop_a, drop_b = stats(np.ones(len(sources)))
            row = {
                "model": name,
                "weights": weights,
                "templates_a": template_set(a)[0],
                "templates_b": template_set(b)[0],
                "original_top1_a": float(acc_a),
                "original_top1_b": float(acc_b),
                "delta_original_top1": float(acc_b - acc_a),
                "paired_top1_diff_a": float(drop_a),
                "paired_top1_diff_b": float(drop_b),
                "delta_paired_top1_diff": float(drop_b - drop_a),
                "n_sources": len(sources),
                "n_pairs": int(arr[:, 1].sum()),
            }
            for key in ("delta_original_top1", "delta_paired_top1_diff"):
                row[f"{key}_ci_low"] = row[f"{key}_ci_high"] = None
            if n_boot > 0:
                rng = np.random.default_rng(seed)
                w = rng.multinomial(len(sources), np.full(len(sources), 1 / len(sources)), size=n_boot).astype(float)
                boot_acc_a, boot_acc_b, boot_drop_a, boot_drop_b = stats(w)
                for key, values in (
                    ("delta_original_top1", boot_acc_b - boot_acc_a),
                    ("delta_paired_top1_diff", boot_drop_b - boot_drop_a),
                ):
                    low, high = np.nanpercentile(values, [2.5, 97.5])
                    row[f"{key}_ci_low"], row[f"{key}_ci_high"] = float(low), float(high)
            rows.append(row)
    return rows


def template_note(results: list[dict[str, Any]]) -> str | None:
    """A sentence when ranked rows come from different prompt template sets (their ranks are not comparable as models
    alone), else ``None``."""
    from evaluation.results import template_set

    sets = sorted({template_set(r) or ("(trained head)", "") for r in results if r.get("status") == "ok"})
    zero_shot = [s for s in sets if s[1]]
    if not zero_shot or len(sets) < 2:
        return None
    names = ", ".join(s[0] for s in sets)
    return (
        f"Rows were computed with different prompt template sets ({names}): a zero-shot model's accuracy depends on "
        "its prompts, so these ranks compare model-and-prompt pairs, not models alone (see the `templates` column and "
        "the template sensitivity table)."
    )


SENSITIVITY_HEADER = ["model", "templates A → B", "orig acc@1 A", "orig acc@1 B", "Δ orig acc@1 [95% CI]",
                      "paired Δacc@1 A", "paired Δacc@1 B", "Δ paired Δacc@1 [95% CI]", "sources"]  # fmt: skip
SENSITIVITY_NOTE = (
    "The same zero-shot model with two prompt template sets on the same images: the change (B minus A, in points) of "
    "the original acc@1 and of the paired counterfactual drop (paired Δacc@1 on the counterfactual config), with 95% "
    "intervals of a paired bootstrap over source images."
)


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:+.2f}" if isinstance(value, float) else str(value)


def _sensitivity_cells(row: dict[str, Any]) -> list[str]:
    def with_ci(key: str) -> str:
        low, high = row[f"{key}_ci_low"], row[f"{key}_ci_high"]
        return _fmt(row[key]) + ("" if low is None else f" [{low:+.2f}, {high:+.2f}]")

    return [
        str(row["model"]),
        f"{row['templates_a']} → {row['templates_b']}",
        f"{row['original_top1_a']:.2f}",
        f"{row['original_top1_b']:.2f}",
        with_ci("delta_original_top1"),
        _fmt(row["paired_top1_diff_a"]),
        _fmt(row["paired_top1_diff_b"]),
        with_ci("delta_paired_top1_diff"),
        str(row["n_sources"]),
    ]


def template_sensitivity_table(rows: list[dict[str, Any]]) -> Any:
    import pandas as pd

    return pd.DataFrame(rows, columns=SENSITIVITY_COLUMNS)


def template_sensitivity_markdown(rows: list[dict[str, Any]]) -> str:
    from builder.release_format.text_out import md_escape

    lines = ["", "## Template sensitivity", "", SENSITIVITY_NOTE, ""]
    lines += ["| " + " | ".join(SENSITIVITY_HEADER) + " |", "|" + "|".join("---" for _ in SENSITIVITY_HEADER) + "|"]
    lines += ["| " + " | ".join(md_escape(c) for c in _sensitivity_cells(row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def template_sensitivity_section(rows: list[dict[str, Any]], note: str | None) -> dict[str, Any]:
    """The table as a section of ``leaderboard.html`` (``leaderboard_sections.html.jinja``)."""
    return {
        "title": "Template sensitivity",
        "note": " ".join(n for n in (note, SENSITIVITY_NOTE if rows else None) if n),
        "header": SENSITIVITY_HEADER,
        "rows": [_sensitivity_cells(row) for row in rows],
        "image": "template_sensitivity.png" if rows else None,
        "image_alt": "template sensitivity" if rows else None,
    }


def plot_template_sensitivity(rows: list[dict[str, Any]], path: Path) -> Path:
    """Δ original acc@1 and Δ paired drop per (model, template pair), with their intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\n{r['templates_a']} → {r['templates_b']}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 1.2 + 0.6 * len(rows)), sharey=True)
    for ax, key, title in (
        (axes[0], "delta_original_top1", "Δ original acc@1 (points)"),
        (axes[1], "delta_paired_top1_diff", "Δ paired Δacc@1 (points)"),
    ):
        values = [r[key] for r in rows]
        errors = [
            [
                v - (r[f"{key}_ci_low"] if r[f"{key}_ci_low"] is not None else v)
                for v, r in zip(values, rows, strict=True)
            ],
            [
                (r[f"{key}_ci_high"] if r[f"{key}_ci_high"] is not None else v) - v
                for v, r in zip(values, rows, strict=True)
            ],
        ]
        ax.errorbar(values, range(len(rows)), xerr=errors, fmt="o", capsize=3)
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_title(title, fontsize=9)
    axes[0].set_yticks(range(len(rows)), labels, fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
