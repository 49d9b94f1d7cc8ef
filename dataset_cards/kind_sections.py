"""The opening paragraph of a card, one per release kind (``lance_pipeline.release_kinds``: each kind's
``card_intro`` names one of these functions).

Each takes the typed manifest and the card's pretty name (escaped already) and returns Markdown. Text that comes from
data (editor names) is escaped.
"""

from __future__ import annotations

from builder import release_format as rf
from dataset_cards.markdown import code_span, md_escape
from lance_pipeline.deviations import dillema_selection
from lance_pipeline.edit_types import MULTI_EDIT_TYPE, spoken_list
from lance_pipeline.release_kinds import editors_of

PROMPT_TO_PROMPT = "prompt_to_prompt"


def edit_axes(manifest: rf.Manifest) -> str:
    """The edit types a release's perturber asked for ("subject, object ... or domain"), from its ``perturb`` stage's
    description, else the release's edit-type vocabulary."""
    asked = next((d.get("edit_types") for d in manifest.stages.values() if isinstance(d, dict) and d.get("edit_types")),
                 None)  # fmt: skip
    names = [t for t in (asked or manifest.release_spec.edit_types) if t != MULTI_EDIT_TYPE]
    return md_escape(spoken_list(names)) if names else "one aspect"


def lance_intro(manifest: rf.Manifest, pretty_name: str) -> str:
    """LANCE: captioned, perturbed, edited. The editing sentence names the release's editor: prompt-to-prompt (the
    paper's) or any editor registered in ``lance_pipeline.registry.EDITORS``."""
    editors = sorted(editors_of(manifest.to_dict()))
    if not editors or editors == [PROMPT_TO_PROMPT]:
        editing = (
            "the image is edited\nto match the new caption with Stable Diffusion, null-text inversion and "
            "prompt-to-prompt attention control"
        )
    else:
        named = ", ".join(code_span(e) for e in editors)
        editing = (
            f"the image is edited\nto match the new caption by the {named} editor{'s' if len(editors) > 1 else ''} "
            "(in place of the paper's prompt-to-prompt; its settings are under *How it was built*)"
        )
    return (
        f"{pretty_name} is a counterfactual stress test for image classifiers made with **LANCE** (*Language-guided\n"
        "Counterfactual Images*, Prabhu et al., NeurIPS 2023). Each source image is captioned, the caption is perturbed "
        f"by a\nlanguage model along one axis ({edit_axes(manifest)}), and "
        f"{editing}. Edits\nthat would change the class or drift from the source image are filtered out. The "
        "ground-truth label of every\ncounterfactual is the label of its source image, so any drop in accuracy is a "
        "sensitivity of the model to the edited\nattribute, not a labelling change.\n\n"
    )


def controlnet_intro(manifest: rf.Manifest, pretty_name: str) -> str:
    """DILLEMA's editor in LANCE's pipeline; which selection the release used (DILLEMA's, or LANCE's filters)."""
    if dillema_selection(manifest.to_dict()) == "dillema":
        selection = (
            "Selection as DILLEMA published it: every rendered image is kept, each with its scores, and no automatic "
            "filter\nremoves any (DILLEMA checked validity with a human study)."
        )
    else:
        selection = (
            "Selection LANCE-filtered: LANCE's label check and CLIP gates (thresholds below) filter the results, and "
            "the best\nrendering of each edit is kept (DILLEMA itself keeps every image and filters none)."
        )
    return (
        f"{pretty_name} is a counterfactual stress test for image classifiers made with a DILLEMA-style editor "
        "(Baresi et\nal., arXiv 2502.04378) inside LANCE's pipeline: each source image is captioned, a language model "
        "picks words that can\nchange without changing the class and alternatives for them, and Stable Diffusion with "
        "ControlNet regenerates the image\nfrom the rewritten caption, conditioned on the photo's structure (Canny "
        f"edges). {selection} The ground-truth label of every counterfactual is\nthe label of its source image.\n"
    )


def _instruct_editors(manifest: rf.Manifest) -> list[dict]:
    """The instruction-edit stages' descriptions (``lance_pipeline.instruct``): editor, model, licence."""
    return [d for d in manifest.stages.values() if isinstance(d, dict) and isinstance(d.get("instruct_editing"), dict)]


def _editor_with_licence(described: dict) -> str:
    """``editor`` (``model``, licence L), with the terms its weights inherit where the stage recorded them."""
    licence = f"licence {md_escape(str(described.get('license')))}"
    if described.get("weights_license"):
        licence += f"; weights: {md_escape(str(described['weights_license']))}"
        if described.get("license_note"):
            licence += f": {md_escape(str(described['license_note']))}"
    return f"{code_span(described.get('editor'))} ({code_span(described.get('model'))}, {licence})"


def instruct_intro(manifest: rf.Manifest, pretty_name: str) -> str:
    """LANCE's pipeline with an instruction editor; the editor, its model and licence, and a non-commercial warning."""
    described = _instruct_editors(manifest)
    editors = ", ".join(_editor_with_licence(d) for d in described) or "an instruction editor"
    restricted = [d for d in described if d.get("non_commercial")]
    warning = (
        "\n\n**Non-commercial model.** Its images were made with a model under a non-commercial licence ("
        + ", ".join(f"{code_span(d.get('model'))}: {md_escape(str(d.get('license')))}" for d in restricted)
        + "); the build accepted it explicitly (`accept_non_commercial_license`). Check those terms before any use "
        "of these images.\n"
        if restricted
        else ""
    )
    return (
        f"{pretty_name} is a counterfactual stress test for image classifiers made with **LANCE**'s pipeline (Prabhu et "
        "al.,\nNeurIPS 2023) and an **instruction editor**: each source image is captioned, the caption is perturbed "
        f"by a language\nmodel along one axis ({edit_axes(manifest)}), the perturbation becomes a written "
        "instruction by its edit type's rule\n(each sample's `instruction`), and the editor "
        f"{editors} edits the image with it. LANCE's label check and CLIP\ngates filter the results. The "
        "ground-truth label of every counterfactual is the label of its source image.\n"
        f"{warning}\n"
    )


def interfaces_intro(manifest: rf.Manifest, pretty_name: str) -> str:
    return (
        f"{pretty_name} holds images **generated** under named distribution shifts with *dataset interfaces* "
        "(Vendrow et\nal., arXiv 2302.07865): one textual-inversion token per class, learned from that class's real "
        'images, is put into\nprompts such as "a photo of a <token> in the snow", and an image is kept only when CLIP '
        "finds both the class and the\nshift in it. Each shift is one config; every image carries its prompt, seed, "
        "token and both CLIP scores.\n"
    )


def discovery_intro(manifest: rf.Manifest, pretty_name: str) -> str:
    return (
        f"{pretty_name} holds generated images of failures that `lance-cf discover` (after Wiles et al., arXiv "
        "2208.08831)\nfound for a model: one config per discovered failure (model, class, description), each image "
        "with the description,\nthe probed model's prediction and the test's statistics. Evaluate other models on it "
        "to see whether a failure\ntransfers.\n"
    )


def edit_failure_modes(manifest: rf.Manifest) -> str:
    """``## Known failure modes`` of a release made with LANCE's pipeline (its label check, CLIP gates, captioner and
    inversion); the built-in kinds' cards have shown it since the first release."""
    return (
        "## Known failure modes\n"
        "\n"
        "- **Label-changing edits**: the label-preservation check and the CLIP gates reduce, but do not remove, edits that\n"
        "  change the class (e.g. editing the object that *is* the class). Check `scores.label_similarity` when in doubt.\n"
        "- **Incomplete or leaking edits**: prompt-to-prompt can under-edit (the counterfactual looks like the reconstruction)\n"
        "  or change regions outside the edited span; `scores.clip_directional` and `scores.clip_image` flag both.\n"
        "- **Caption errors**: a wrong caption yields a meaningless perturbation; the edited span is only as good as the\n"
        "  captioner.\n"
        "- **Reconstruction artefacts**: null-text inversion is not exact; compare against the `reconstructed` config to\n"
        "  separate the effect of the edit from the effect of regeneration.\n\n"
    )
