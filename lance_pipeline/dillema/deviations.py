"""Where the ControlNet editor and DILLEMA's text stages depart from DILLEMA (Baresi et al., arXiv 2502.04378, and its code
irfanmasoudi/DILLEMA): the DILLEMA table of ``lance_pipeline.deviations``, listed by the ControlNet and LANCE release
kinds."""

from __future__ import annotations

from lance_pipeline.deviations import (
    Deviation,
    DeviationTable,
    Manifest,
    described,
    described_value,
    gates_filter,
    has_stage,
    label_check_filters,
)

# A release ran DILLEMA's method when one of these stages ran.
DILLEMA_STAGES = ("controlnet_edit", "dillema_keywords", "dillema_alternatives", "dillema_counterfactual")


def _controlnet_condition(manifest: Manifest) -> str | None:
    return described_value(manifest, "controlnet_edit", "controlnet_editing", "condition", "name")


def _dillema_keeps_best_only(manifest: Manifest) -> bool:
    candidates = described_value(manifest, "controlnet_edit", "controlnet_editing", "candidates") or {}
    per_edit = int(candidates.get("images_per_edit") or 1) * len(candidates.get("conditioning_scales") or [1.0])
    return int(candidates.get("keep_per_edit") or 1) < per_edit


DILLEMA_ROWS = (
    Deviation(
        "dillema",
        "condition",
        "HED edges (`lllyasviel/Annotators` ControlNetHED.pth) with the HED ControlNet",
        "Canny edges (`cv2.Canny`, 100/200) with `lllyasviel/sd-controlnet-canny`",
        "HED's annotator checkpoint is a pickle, which this project refuses to load (it can run code)",
        "`edit` stage: `condition` (`canny` or `depth`; `hed` is refused)",
        "the condition is Canny",
        lambda m: _controlnet_condition(m) == "canny",
    ),
    Deviation(
        "dillema",
        "captions",
        'two captions per image, nucleus-sampled and joined with ". ", not conditioned on the class',
        "one beam-search caption, conditioned on the class",
        "one deterministic caption shared with LANCE's preset, so the two editors start from the same text",
        "`caption` stage: `num_captions: 2`, `do_sample: true`, `num_beams: 1`, `label_conditioned: false` (preset "
        "`hardimagenet-dillema`)",
        "one caption per image",
        lambda m: (
            bool(described(m, "blip2_captioner"))
            and all(int(d.get("num_captions") or 1) == 1 for d in described(m, "blip2_captioner"))
        ),
    ),
    Deviation(
        "dillema",
        "caption length and prefix",
        "LAVIS `Blip2OPT.generate` defaults, which DILLEMA's call leaves alone: at most 30 new tokens (`max_length=30`, "
        'passed as `max_new_tokens`), no minimum (`min_length=1` counts the prompt), the prompt "a photo of" decoded '
        "away (code: salesforce-lavis `blip2_opt.py`, `blip2_caption_opt6.7b.yaml`)",
        'LANCE\'s: 20 to 100 new tokens, each caption starting with the prompt "a photo of"',
        "the LANCE-filtered preset captions as LANCE does, so both editors start from the same text",
        "`caption` stage: `max_new_tokens: 30`, `min_new_tokens: 0`, `keep_prompt: false` (preset "
        "`hardimagenet-dillema`)",
        "the captions differ from LAVIS's defaults in length or prefix",
        lambda m: any(
            int(d.get("max_new_tokens") or 0) != 30
            or int(d.get("min_new_tokens") or 0) != 0
            or d.get("keep_prompt", True)
            for d in described(m, "blip2_captioner")
        ),
    ),
    Deviation(
        "dillema",
        "captions over 77 tokens",
        "rendered cut at the text encoder's 77 tokens (diffusers' pipeline truncates the prompt and logs the cut words)",
        "refused before rendering, each listed among its sample's edit candidates with its length as the reason "
        "(their change may lie past the cut)",
        "an edit whose changed words the encoder never reads would be rendered for nothing",
        "`edit` stage: `long_captions: truncate` (preset `hardimagenet-dillema`)",
        "the ControlNet stage refuses long captions",
        lambda m: any((d.get("long_captions") or "refuse") == "refuse" for d in described(m, "controlnet_edit")),
    ),
    Deviation(
        "dillema",
        "captioner model",
        "BLIP-2 OPT-6.7B fine-tuned on COCO captions (LAVIS `caption_coco_opt6.7b`)",
        "BLIP-2 OPT-2.7B (`Salesforce/blip2-opt-2.7b`, the pinned captioner of every preset)",
        "the presets share one pinned, checked captioner; the COCO-finetuned 6.7B is a model id away",
        "`caption` stage: `model`, `revision`",
        "the captioner is BLIP-2 OPT-2.7B",
        lambda m: any("opt-2.7b" in str(d.get("model")) for d in described(m, "blip2_captioner")),
    ),
    Deviation(
        "dillema",
        "counterfactuals per image",
        "one counterfactual caption per image",
        "`n_counterfactuals` captions per image, each its own seeded pick of keywords and alternatives",
        "more edits per image for the same captioning and inversion-free rendering cost",
        "`rewrite` stage: `n_counterfactuals` (preset `hardimagenet-dillema`: 1)",
        "more than one counterfactual per image",
        lambda m: any(int(d.get("n_counterfactuals") or 1) > 1 for d in described(m, "dillema_counterfactual")),
    ),
    Deviation(
        "dillema",
        "rewrite checks",
        "any answer holding two quoted sentences is the counterfactual",
        "a rewrite must contain every applied alternative and keep the class name where the caption had it (else "
        "asked again, then dropped)",
        "a rewrite that ignores its alternatives, or drops the class, is not the counterfactual DILLEMA asked for",
        "`rewrite` stage: `require_alternatives`, `require_class_kept`",
        "the rewrite stage checks its answers",
        lambda m: any(
            d.get("require_alternatives") or d.get("require_class_kept") for d in described(m, "dillema_counterfactual")
        ),  # fmt: skip
    ),
    Deviation(
        "dillema",
        "LLM",
        "LLaMA-2-13B-chat (GGML q5_1 through ctransformers), temperature 0.1, top_p 0.85",
        "an instruction LLM through transformers (default `Qwen/Qwen2.5-7B-Instruct`), same temperature and top_p",
        "GGML files load only through llama.cpp bindings; the project loads safetensors through transformers",
        "`keywords`, `alternatives`, `rewrite` stages: `model`",
        "always",
    ),
    Deviation(
        "dillema",
        "alternatives prompt",
        "one JSON object of alternatives for all keywords of a caption",
        "one question per keyword, with the keyword's aspect",
        "small models answer a single-keyword question far more often in a usable form",
        "cannot be changed",
        "always",
    ),
    Deviation(
        "dillema",
        "retries",
        "the script asks again until a regex matches, and a shell loop restarts it on crashes",
        "at most `max_attempts` (3) seeded attempts per question; failures are counted per sample",
        "a bounded, reproducible build",
        "`keywords`, `alternatives`, `rewrite` stages: `max_attempts`",
        "always",
    ),
    Deviation(
        "dillema",
        "seeds",
        "one global generator seeded 1024 for every image",
        "one seed per candidate from (sample seed, image index)",
        "a sample's images must not depend on which samples ran before it",
        "cannot be changed",
        "always",
    ),
    Deviation(
        "dillema",
        "label check",
        "none",
        "LANCE's label check on the rewritten captions",
        "the LANCE-filtered preset applies LANCE's checks to both editors",
        "remove the `label_check` stage, or set its thresholds to null (preset `hardimagenet-dillema`)",
        "the label check filters",
        label_check_filters,
    ),
    Deviation(
        "dillema",
        "automatic filter",
        "none: every generated image is kept (validity came from a human study)",
        "LANCE's CLIP gates against the source image",
        "the LANCE-filtered preset applies LANCE's checks to both editors",
        "`edit` stage: `clip_*_threshold: -1`, `require_edited_closer: false` (preset `hardimagenet-dillema`)",
        "the CLIP gates filter",
        lambda m: gates_filter(m, "controlnet_edit", "controlnet_editing"),
    ),
    Deviation(
        "dillema",
        "images kept",
        "all 5 images of every counterfactual",
        "the `keep_per_edit` best by CLIP directional similarity",
        "the LANCE-filtered preset keeps the best rendering of each edit",
        "`edit` stage: `keep_per_edit` (preset `hardimagenet-dillema` keeps all 5)",
        "fewer kept than rendered per edit",
        _dillema_keeps_best_only,
    ),
)


DILLEMA_DEVIATIONS = DeviationTable(
    "dillema",
    "DILLEMA (the ControlNet editor)",
    "Baresi et al., arXiv 2502.04378, and its code irfanmasoudi/DILLEMA",
    DILLEMA_ROWS,
    applies=has_stage(*DILLEMA_STAGES),
)
