"""Where LANCE's pipeline departs from its paper (Prabhu et al., NeurIPS 2023): the rows of ``lance_pipeline.deviations``'s
table for LANCE, listed by the LANCE and ControlNet release kinds (``lance_pipeline/*/release_kind.py``)."""

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

# A release ran LANCE's method when one of these stages ran (a ControlNet release may run only its captioner).
LANCE_EDIT_STAGES = ("prompt_to_prompt_edit", "null_text_inversion", "llm_perturber", "lance_r_edit")


def _perturber_without_adapter(manifest: Manifest) -> bool:
    return any(d.get("adapter") is None for d in described(manifest, "llm_perturber"))


def _perturber_asks_weather(manifest: Manifest) -> bool:
    return any("weather" in (d.get("edit_types") or ()) for d in described(manifest, "llm_perturber"))


LANCE_ROWS = (
    Deviation(
        "lance",
        "caption length",
        "20 to 100 tokens (Table 6), counted over the whole decoder sequence in the authors' LAVIS call",
        "`min_new_tokens` / `max_new_tokens` bound the generated tokens only",
        "with per-sample prompts and padding, a bound on the whole sequence would depend on the batch; captions come "
        "out a few tokens longer",
        "`caption` stage: `min_new_tokens`, `max_new_tokens`",
        "a `blip2_captioner` stage ran",
        has_stage("blip2_captioner"),
    ),
    Deviation(
        "lance",
        "caption prompt",
        "BLIP-2 captions the image (section 3.1); the prompt is not given",
        "the decoder is prompted with `a photo of a CLASS`, so every caption names the class and starts with the "
        "domain phrase",
        "the perturber must keep the class and the label check protects it; a `domain` edit needs a domain word",
        "`caption` stage: `label_conditioned`, `domain_phrase`",
        "a label-conditioned `blip2_captioner` ran",
        lambda m: any(d.get("label_conditioned") for d in described(m, "blip2_captioner")),
    ),
    Deviation(
        "lance",
        "perturber model",
        "LLaMA-7B LoRA-finetuned on 0.6k GPT-3.5 caption edits (section 3.1)",
        "an instruction LLM used few-shot (default `Qwen/Qwen2.5-7B-Instruct`), no adapter",
        "the authors' adapter is a lit-llama state dict of LLaMA-1 that no current library loads, and its data was "
        "not released; `lance-cf perturber collect` and `train` rebuild both",
        "`perturb` stage: `model`, `adapter` (train one with `lance-cf perturber train`)",
        "the `perturb` stage has no adapter",
        _perturber_without_adapter,
    ),
    Deviation(
        "lance",
        "perturber instructions",
        "the Table 5 prompts",
        "instructions in our words after Table 5, naming the class that must stay, with one worked example per type",
        "the paper found in-prompt examples help; naming the class keeps edits off it",
        "`perturb` stage: `instructions`, `few_shot`",
        "an `llm_perturber` stage ran",
        has_stage("llm_perturber"),
    ),
    Deviation(
        "lance",
        "edits per image",
        "N edits per image, each of a sampled type (Algorithm 1, lines 8-10)",
        "`n_per_type` edits for every requested type (default 3 x 6)",
        "every image gets every kind of edit, so per-type results compare on the same images",
        "`perturb` stage: `n_per_type`, `edit_types`",
        "an `llm_perturber` stage ran",
        has_stage("llm_perturber"),
    ),
    Deviation(
        "lance",
        "edit types",
        "five types: subject, object, background, adjective, domain (section 3.1, Algorithm 1)",
        "six: weather is its own type, as in the authors' code",
        "the authors' code asks for weather separately (its `perturb_prompts`); the paper counts it as background",
        "`perturb` stage: `edit_types`",
        "the `perturb` stage asks for weather edits",
        _perturber_asks_weather,
    ),
    Deviation(
        "lance",
        "perturber decoding",
        "not given (the authors' code samples at temperature 1.0 with no seed)",
        "greedy; with `do_sample` each (sample, edit type) draws seeded noise",
        "edits must be reproducible from the sample's seed, whatever the batch",
        "`perturb` stage: `do_sample`, `temperature`, `top_p`",
        "an `llm_perturber` stage ran",
        has_stage("llm_perturber"),
    ),
    Deviation(
        "lance",
        "label check",
        "a sentence-BERT similarity between the edit and the class below epsilon = 0.5, and an edit not similar to "
        "the phrase it replaces (section 3.1; the second threshold is not given)",
        "`all-MiniLM-L6-v2`; both the removed and the inserted span checked against the class (0.5); removed vs "
        "inserted span below 0.8",
        "checking the removed span only lets an insertion of the class name through; 0.8 is measured on MiniLM",
        "`label_check` stage: `model`, `label_threshold`, `span_threshold`",
        "the label check filters",
        label_check_filters,
    ),
    Deviation(
        "lance",
        "label check off",
        "edits similar to the class are filtered (section 3.1)",
        "scores are recorded, nothing is rejected",
        "the offline demo's random models write nonsense that a filter would remove entirely",
        "`label_check` stage: `label_threshold`, `span_threshold` (null switches a check off)",
        "the label check's thresholds are null",
        lambda m: bool(described(m, "label_check")) and not label_check_filters(m),
    ),
    Deviation(
        "lance",
        "CLIP directional criterion",
        "phi = 1 - cos(E_I(x) - E_I(x'), E_T(c) - E_T(c')) > tau = 0.2 (eq. 2, Algorithm 1 line 13)",
        "cos(E_I(x') - E_I(x), E_T(c') - E_T(c)) >= 0.2, as the authors' code",
        "eq. 2 as printed is a distance (StyleGAN-NADA's loss) and would keep edits that move against the caption",
        "`edit` stage: `clip_directional_threshold`",
        "the CLIP gates filter",
        lambda m: gates_filter(m, "prompt_to_prompt_edit", "prompt_to_prompt"),
    ),
    Deviation(
        "lance",
        "gate comparison image",
        "the source image x (eq. 2)",
        "the reconstruction of x from its inversion, as the authors' code",
        "the gates should judge what the edit changed, not the inversion's own error",
        "cannot be changed",
        "a `prompt_to_prompt_edit` stage ran",
        has_stage("prompt_to_prompt_edit"),
    ),
    Deviation(
        "lance",
        "CLIP gates off",
        "every counterfactual passes the image-quality gates (Algorithm 1, Table 6)",
        "every gate threshold at -1 and `require_edited_closer` off: nothing is rejected",
        "the offline demo's random models pass nothing",
        "`edit` stage: `clip_*_threshold`, `require_edited_closer`",
        "the CLIP gates of the `edit` stage cannot reject",
        lambda m: (
            bool(described(m, "prompt_to_prompt_edit"))
            and not gates_filter(m, "prompt_to_prompt_edit", "prompt_to_prompt")
        ),
    ),
    Deviation(
        "lance",
        "selection in the sweep",
        "the sweep value with the best CLIP directional similarity (section 3.2)",
        "the largest passing self-replace fraction (the authors' code in effect)",
        "chosen in the config",
        "`edit` stage: `selection: best_directional`",
        "`selection` is `largest_passing`",
        lambda m: described_value(m, "prompt_to_prompt_edit", "prompt_to_prompt", "selection") == "largest_passing",
    ),
    Deviation(
        "lance",
        "sensitive edits",
        "the authors inspected the images of their human study by hand and excluded those whose edit changed a "
        "person's perceived gender, race, age, religion or body (Ethical Issues)",
        "an automatic first pass marks every edit that adds, removes or changes a perceived gender, race or skin tone, "
        "age, religion, body or disability of a person (a word list with phrase rules, then a sentence model); "
        "measured on 259 hand-written held-out caption pairs: 100.0% precision, 97.9% recall (word list; optimistic, "
        "as the set's misses were read before the vocabulary was written: docs/method.md) "
        "(benchmarks/bench_sensitive_edits.py)",
        "a build has no person in the loop; the marks show a reviewer where to look (`lance-cf review`), and misses "
        "remain possible",
        "`sensitive_edit_screen` stage: `screen` (`flag` or `drop`), `similarity_threshold`",
        "a `sensitive_edit_screen` stage ran",
        has_stage("sensitive_edit_screen"),
    ),
    Deviation(
        "lance",
        "inversion",
        "null-text inversion (section 3.2)",
        "a cheaper inversion method",
        "chosen in the config",
        "image stages: `inversion: null_text`",
        "`inversion` is not `null_text`",
        lambda m: described_value(m, "null_text_inversion", "inversion", default="null_text") != "null_text",
    ),
    Deviation(
        "lance",
        "long edited captions",
        "not addressed",
        "an edited caption longer than the text encoder's context (77 tokens) is refused before rendering, recorded "
        "with that reason",
        "a change past the cut would never reach the image",
        "cannot be changed",
        "a `prompt_to_prompt_edit` stage ran",
        has_stage("prompt_to_prompt_edit"),
    ),
)


LANCE_DEVIATIONS = DeviationTable(
    "lance",
    "LANCE",
    "Prabhu et al., NeurIPS 2023: section 3, Algorithm 1, Tables 5 and 6",
    LANCE_ROWS,
    applies=has_stage(*LANCE_EDIT_STAGES),
)
