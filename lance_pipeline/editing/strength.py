"""Edit strength: every gate-passing candidate of an edit, kept as a graded series of that edit (config ``strength``).

LANCE (Prabhu et al., NeurIPS 2023, section 3.2) renders each edited caption once per self-attention injection
fraction ``f`` of a sweep (0.4 to 0.9): ``f`` is the fraction of the denoising steps during which the source image's
self-attention maps are injected into the edited branch. The larger ``f``, the more of the source's layout the edit
keeps ("larger changes, say editing the background or weather, require a small value"). The CLIP gates score every
candidate and one is kept per edit; the others are the same edit at other strengths. With the image stages' option
``keep_candidates`` they are released too, one sample each, in the ``strength`` config.

**Strength** is defined once, in ``lance_pipeline.edit_strength`` (shared with evaluation): ``strength = 1 -
self_replace`` (rounded to 10 decimals, so that ``1 - 0.7`` is stored as ``0.3``), the fraction of the steps in which
the edited branch's self-attention runs free of the source's.
Larger is a stronger edit; the paper's sweep 0.4-0.9 gives strengths 0.1-0.6. Two fractions that cover the same number
of steps (``options.steps_of``) render the same image: with 50 steps no two of the paper's sweep do.

Each ``strength`` sample carries its ``self_replace`` and ``strength``, every score of the candidate, the edit it
renders (``edit_index`` among the record's kept edits), whether it is the selected candidate (``selected``), and two
links: ``source_key`` is its ``original`` (as for every derived sample) and ``counterfactual_key`` the key of the
edit's selected sample in the ``counterfactual`` config. Only candidates that passed every gate are kept, so an edit
may be represented at some strengths only (a single one when one candidate passed); evaluation's headline curve
therefore uses only the edits seen at every strength, so that each strength scores the same images
(``evaluation.strength``), and keeps the curve pooled over every candidate as a second view.

The ControlNet editor (DILLEMA, ``lance_pipeline.dillema.controlnet_editing``) is not mapped onto this axis: its
candidates are separate regenerations from noise (per seed and conditioning scale). The conditioning scale sets how
closely the source's edges are followed, not how much of the source image is kept; no scale gives the source back, and
the seed changes the image as much as the scale does. Its options refuse ``keep_candidates`` with that reason.

Keeping the candidates costs storage, not computation: they are rendered and scored for the selection anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lance_pipeline.edit_strength import STRENGTH_CONFIG, STRENGTH_DEFINITION, strength_of  # noqa: F401 (re-exported)
from lance_pipeline.stage import SCORE_NAMES, MetadataField, ReleaseOutput

STRENGTH_FIELD = "strength_samples"  # the edit stage's record field the config is written from
STRENGTH_OPTION = "keep_candidates"


STRENGTH_FIELDS = (
    MetadataField("editor", "string", description="the editor that rendered the sample"),
    MetadataField(
        "strength",
        "float64",
        description=f"edit strength: {STRENGTH_DEFINITION}; larger is stronger",
        minimum=0.0,
        maximum=1.0,
        minimum_exclusive=True,
    ),
    MetadataField("edit_index", "int64", description="which of the source image's kept edits this renders", minimum=0),
    MetadataField("selected", "bool", description="this candidate is the edit's sample in the counterfactual config"),
    MetadataField(
        "counterfactual_key",
        "string",
        description="key of the edit's selected sample in the counterfactual config",
        references="counterfactual",
    ),
)

STRENGTH_OUTPUT = ReleaseOutput(
    STRENGTH_CONFIG,
    STRENGTH_FIELD,
    "st",
    many=True,
    description=(
        "every gate-passing candidate of each LANCE edit, one row per self-attention fraction of the sweep, with its "
        "strength (1 - self_replace); source_key is its original, counterfactual_key the edit's selected sample"
    ),
    fields=STRENGTH_FIELDS,
    enabled_by=STRENGTH_OPTION,
    requires=("counterfactual",),  # counterfactual_key names a sample there
    # an edit (named by its selected sample) has one candidate per strength, and exactly one of them is selected
    unique=(("counterfactual_key", "strength"),),
    one_true_per=(("selected", "counterfactual_key"),),
)


def strength_samples(
    candidates: list[Any],
    records: list[dict[str, Any]],
    edit_positions: list[int],
    counterfactual_key: Any,
    editor: str,
) -> list[dict[str, Any]]:
    """The ``strength`` samples of one source image: every gate-passing candidate, ordered by edit then strength.

    Args:
        candidates: The rendered candidates (``candidate_selection.Candidate``), in the selector's order.
        records: The selector's candidate records, aligned with ``candidates`` (``edit_index`` local to the rendered
            edits, before the stage maps it to the record's edit list).
        edit_positions: ``edit_positions[local index]`` is the edit's index among the record's kept edits.
        counterfactual_key: ``counterfactual_key(j)`` is the key of the record's ``j``-th selected sample.
        editor: The editor's name.
    """
    # The selected samples are written in edit order (select_candidates), so the j-th selected edit is sample j.
    selected_edits = [r["edit_index"] for r in records if r["chosen"]]
    links = {edit: counterfactual_key(j) for j, edit in enumerate(selected_edits)}
    samples = []
    for candidate, record in zip(candidates, records, strict=True):
        if not record["passed"]:
            continue
        samples.append(
            {
                "image": candidate.image,
                "edit_type": record["edit_type"],
                "edited_caption": record["edited_caption"],
                "original_span": record["original_span"],
                "edited_span": record["edited_span"],
                "self_replace": record["self_replace"],
                "scores": {name: record["scores"].get(name) for name in SCORE_NAMES},
                "editor": editor,
                "strength": strength_of(record["self_replace"]),
                "edit_index": edit_positions[record["edit_index"]],
                "selected": bool(record["chosen"]),
                "counterfactual_key": links[record["edit_index"]],
            }
        )
    samples.sort(key=lambda s: (s["edit_index"], s["strength"]))
    return samples


def without_lost_edits(
    candidates: list[dict[str, Any]], lost: set[Any], removal: Callable[[dict[str, Any]], dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A screen removed the selected candidate (the counterfactual's image) of the edits whose ``counterfactual_key``
    is in ``lost``: their other candidates go too, because they would be a series linked to a sample that is not
    released, with no selected member, which the release's declared invariants refuse. Returns the candidates kept
    and a removal record (``removal(candidate)``) for each one dropped."""
    kept, removed = [], []
    for candidate in candidates:
        if candidate.get("counterfactual_key") in lost:
            removed.append(removal(candidate))
        else:
            kept.append(candidate)
    return kept, removed
