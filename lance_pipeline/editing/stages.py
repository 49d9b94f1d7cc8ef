"""LANCE image stages: inversion, reconstruction, counterfactual edits, LANCE-R edits.

Prabhu, Yenamandra, Chattopadhyay, Hoffman, "LANCE: Stress-testing Visual Models by Generating Language-guided
Counterfactual Images", NeurIPS 2023 (arXiv 2305.19164), section 3.2 and Algorithm 1. The stages are thin: the work
is in the pieces they assemble,

* ``sd_components``: the Stable Diffusion components an editor owns (shared weakly between the editors of one
  process);
* ``inversion``: the inversion methods, chosen by name from ``lance_pipeline.registry.INVERSIONS`` (null-text by default);
* ``prompt_to_prompt``: the prompt-to-prompt editor (``lance_pipeline.registry.EDITORS``), which renders every edited
  caption at every self-attention fraction of the sweep;
* ``candidate_selection``: CLIP gates and the choice of one candidate per edit, with a CLIP scorer shared by the
  stages of a build (``clip_gates``, loaded by ``clip_loader``).

Stages (``lance_pipeline.stage.Stage``):

* ``InversionStage`` (``invert``): ``{"inversion": {"latent", "null_embeddings", "caption", "method",
  "inner_steps", ...}}`` (see ``inversion.InversionMethod``), the stage's batch inverted together.
* ``ReconstructionStage`` (``reconstruct``): ``{"reconstruction": PIL image}``, the inversion regenerated with its
  own caption: decoded from the inversion's ``reconstruction_latent`` when the method computed the source branch
  anyway (null-text does), sampled otherwise.
* ``CounterfactualEditStage`` (``edit``): ``{"counterfactuals": [...], "edit_candidates": [...]}``, and with
  ``keep_candidates`` ``"strength_samples"``: every gate-passing candidate (config ``strength``, see ``strength``).
* ``LanceREditStage`` (``lance_r_edit``): ``{"lance_r": [...], "lance_r_candidates": [...]}``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from lance_pipeline.clip.gates import ClipScorer
from lance_pipeline.editing.candidate_selection import (  # noqa: F401  (re-exported: the names image_editing always had)
    Candidate,
    CandidateSelector,
    EditRequest,
    SweepResult,
    select_candidates,
    span_of,
)
from lance_pipeline.editing.cost import count_network_cost, editor_networks
from lance_pipeline.editing.options import DEFAULT_SELF_REPLACE_SWEEP, ImageEditorOptions  # noqa: F401
from lance_pipeline.editing.prompt_to_prompt import ImageEditor, PromptToPromptEditor  # noqa: F401
from lance_pipeline.editing.sd_components import (  # noqa: F401
    DDIM_OVERRIDES,
    DEFAULT_MODEL,
    DEFAULT_REVISION,
    DTYPES,
    StableDiffusionComponents,
    load_stable_diffusion_components,
)
from lance_pipeline.editing.strength import STRENGTH_DEFINITION, STRENGTH_FIELD, STRENGTH_OUTPUT, strength_samples
from lance_pipeline.models.needs import SD_COMPONENT_FILES, ModelOption, clip_option
from lance_pipeline.registry import EDITORS
from lance_pipeline.stage import SCORE_NAMES, MetadataField, Record, ReleaseOutput, SampleFailure, stage_options

# Which editor rendered a sample (``lance_pipeline.registry.EDITORS``): one field, so releases of two editors compare.
EDITOR_FIELD = MetadataField("editor", "string", description="the editor that rendered the sample")

logger = logging.getLogger(__name__)

SCORE_FIELDS = SCORE_NAMES  # the release's per-sample scores (lance_pipeline.stage)
STAGE_VERSION = "2"  # goes into the manifest; bump when a stage's outputs change for the same inputs


class _ImageStage:
    """Shared construction, loading and description of the image stages, whatever the editor renders with.

    ``editor_name`` names the editor in ``lance_pipeline.registry.EDITORS``; ``options_class`` is the typed options
    structure, an ``EditorOptions`` subclass (so it holds the CLIP scorer and gates every editor shares). A new editor
    with its own options subclasses a stage and sets both (docs/architecture.md, "An editor").
    """

    name = "image"
    uses_clip = False
    editor_name = "prompt_to_prompt"
    options_class = ImageEditorOptions
    version = STAGE_VERSION
    model_options = (ModelOption("model", SD_COMPONENT_FILES, cache_dir="cache_dir", role="Stable Diffusion"),)

    def __init__(self, options: ImageEditorOptions | None = None, /, scorer=None, **values: Any) -> None:
        try:
            self.options = stage_options(type(self), options, values)
        except TypeError as err:
            known = ", ".join(f.name for f in dataclasses.fields(self.options_class))
            raise ValueError(f"{type(self).__name__}: {err}; known options: {known}") from err
        self.scorer = scorer
        self.editor = None

    def load(self, device: str) -> None:
        self.editor = EDITORS.resolve(self.editor_name).load(self.options, device)
        if self.uses_clip:
            if self.scorer is None:
                self.scorer = ClipScorer(
                    model=self.options.clip_model,
                    pretrained=self.options.clip_pretrained,
                    revision=self.options.clip_revision,
                    batch_size=self.options.clip_batch_size,
                    cache_dir=self.options.cache_dir,
                )
            self.scorer.load(device)

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        """Run the stage on a batch (the engine measures and records its peak memory: ``builder.stage_memory``)."""
        raise NotImplementedError

    def _require_editor(self):
        if self.editor is None:
            raise RuntimeError(f"{type(self).__name__}.load(device) must be called before process()")
        return self.editor

    def describe(self) -> dict[str, Any]:
        """Name and version, what the options record (``EditorOptions.describe``: model, revision, dtype, image size
        and the editor's own constants) and, once loaded, what the editor's components record (a Stable Diffusion
        editor: its scheduler config and VAE scaling factor)."""
        description: dict[str, Any] = {"name": self.name, "version": self.version, **self.options.describe()}
        describe_components = getattr(self.editor, "describe_components", None)
        if describe_components is not None:
            description.update(describe_components())
        return description


class InversionStage(_ImageStage):
    """``invert``: inversion of ``record["image"]`` with ``record["caption"]`` (method: option ``inversion``)."""

    name = "invert"
    consumes = {"image": "image", "caption": "str"}
    produces = {"inversion": "dict"}

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        import torch

        editor = self._require_editor()
        out: list[Record | SampleFailure | None] = [None] * len(records)
        todo = []
        for position, record in enumerate(records):
            caption = record.get("caption")
            if not isinstance(caption, str) or not caption.strip():
                out[position] = SampleFailure("invert: record has no caption (the caption stage must run first)")
            else:
                todo.append(position)
        # The whole batch is inverted together (one UNet call per step for all its images); its counted cost is
        # shared equally by its images.
        with count_network_cost(editor_networks(editor)) as cost:
            inversions = editor.invert_batch([records[p]["image"] for p in todo], [records[p]["caption"] for p in todo])
        for position, inversion in zip(todo, inversions, strict=True):
            inversion = {**inversion, "cost": cost.to_dict(1 / len(todo))}
            if not (torch.isfinite(inversion["latent"]).all() and torch.isfinite(inversion["null_embeddings"]).all()):
                out[position] = SampleFailure("invert: inversion diverged (non-finite latent or embeddings)")
            else:
                out[position] = {"inversion": inversion}
        return out


class ReconstructionStage(_ImageStage):
    """``reconstruct``: the inverted image regenerated with its own caption (config ``reconstructed``)."""

    name = "reconstruct"
    consumes = {"inversion": "dict", "caption": "str"}
    produces = {"reconstruction": "image"}
    outputs = (ReleaseOutput("reconstructed", "reconstruction", "rec"),)

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        editor = self._require_editor()
        out: list[Record | SampleFailure] = []
        for record in records:
            problem = editor.check_inversion(record.get("inversion"), record.get("caption"))
            if problem:
                out.append(SampleFailure(f"reconstruct: {problem}"))
                continue
            out.append({"reconstruction": editor.reconstruct(record["inversion"])})
        return out


class CounterfactualEditStage(_ImageStage):
    """``edit``: counterfactuals for the kept caption edits, rendered by the editor and gated by CLIP.

    Returns ``{"counterfactuals": [...], "edit_candidates": [...]}``. A record whose edits all fail the gates gets
    empty lists (not a failure): the rejected candidates with their reasons are the record's data. With the option
    ``keep_candidates`` it also returns ``{"strength_samples": [...]}``, every gate-passing candidate (``strength``).
    """

    name = "edit"
    uses_clip = True
    model_options = (*_ImageStage.model_options, clip_option())
    consumes = {"key": "str", "caption": "str", "inversion": "dict", "edits": "list"}
    produces = {"counterfactuals": "list", "edit_candidates": "list", STRENGTH_FIELD: "list", "edit_cost": "dict"}
    outputs = (
        ReleaseOutput("counterfactual", "counterfactuals", "cf", many=True, fields=(EDITOR_FIELD,)),
        STRENGTH_OUTPUT,
    )
    edits_field = "edits"
    output_field = "counterfactuals"
    candidates_field = "edit_candidates"
    # The record field of the strength series (None: this stage keeps no strength config).
    strength_field: str | None = STRENGTH_FIELD
    # The record field of what rendering and gating the record's edits cost, counted by hooks (None: not recorded).
    cost_field: str | None = "edit_cost"
    word_check = False

    def __init__(self, options: ImageEditorOptions | None = None, /, scorer=None, **values: Any) -> None:
        super().__init__(options, scorer=scorer, **values)
        if self.options.keep_candidates and self.strength_field is None:
            raise ValueError(
                f"{type(self).__name__}: keep_candidates: this stage declares no strength config (only the edit "
                "stage's candidates are kept, as config strength); set keep_candidates: false"
            )

    # The key of the manifest's stage description that holds the editor's own record, selection and gates.
    editing_section = "prompt_to_prompt"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), self.editing_section: self._editing_description()}

    def _editor_and_gates(self) -> dict[str, Any]:
        """What every editor's record holds: the editor's own description, the gates and the CLIP model."""
        editor = self.editor.describe() if self.editor is not None else {"editor": self.editor_name}
        return {
            **editor,
            "gates": dataclasses.asdict(self.options.gate_thresholds()),
            "clip": self.scorer.describe() if self.scorer is not None and hasattr(self.scorer, "describe") else None,
        }

    def _editing_description(self) -> dict[str, Any]:
        o = self.options
        return {
            **self._editor_and_gates(),
            "selection": self.selection,
            "selection_rule": self._selector().describe(),
            **(
                {"keep_candidates": o.keep_candidates, "strength": STRENGTH_DEFINITION}
                if self.strength_field is not None
                else {}
            ),
        }

    @property
    def selection(self) -> str:
        """The options' ``selection``; an editor whose options have none keeps the best directional candidate (the
        paper's rule)."""
        return getattr(self.options, "selection", "best_directional")

    def _selector(self) -> CandidateSelector:
        return CandidateSelector(
            self.scorer, self.options.gate_thresholds(), selection=self.selection, word_check=self.word_check
        )

    def _edits(self, record: Record) -> list[dict]:
        return [e for e in record.get(self.edits_field) or [] if e.get("kept")]

    # What the editor's text encoder reads of an edit (the length check counts its tokens), named in rejections.
    rendered_text_name = "edited caption"

    def _rendered_text(self, edit: dict) -> str:
        return edit["edited_caption"]

    def _request(self, edit: dict) -> EditRequest:
        """The editor's request for one kept edit (an editor that reads more of the edit returns a subclass)."""
        return EditRequest(edit["edited_caption"], span_of(edit, "edited_span"))

    def _split_by_length(self, edits: list[dict]) -> tuple[list[int], list[dict]]:
        """Positions of the edits whose caption fits the text encoder, and rejection records for the others."""
        editor = self._require_editor()
        limit = editor.max_prompt_tokens
        positions, rejected = [], []
        for index, edit in enumerate(edits):
            length = editor.count_tokens(self._rendered_text(edit))
            if length <= limit:
                positions.append(index)
                continue
            label_scores = edit.get("scores") or {}
            rejected.append(
                {
                    "edit_index": index,
                    "edit_type": edit.get("edit_type"),
                    "edited_caption": edit["edited_caption"],
                    "original_span": span_of(edit, "original_span"),
                    "edited_span": span_of(edit, "edited_span"),
                    "self_replace": None,
                    "attention_edit": None,
                    "reweighted_tokens": None,
                    "scores": {k: label_scores.get(k) for k in ("label_similarity", "span_similarity")},
                    "passed": False,
                    "chosen": False,
                    "reject_reason": f"{self.rendered_text_name} is {length} tokens, more than the text encoder's "
                    f"{limit}: the edit would not reach the image",
                }
            )
        return positions, rejected

    def process(self, records: list[Record]) -> list[Record | SampleFailure]:
        editor = self._require_editor()
        selector = self._selector()
        out: list[Record | SampleFailure] = []
        for record in records:
            caption = record.get("caption")
            problem = editor.check_source(record)
            if problem:
                out.append(SampleFailure(f"{self.name}: {problem}"))
                continue
            edits = self._edits(record)
            for index, edit in enumerate(edits):
                if not isinstance(edit.get("edited_caption"), str) or not edit["edited_caption"].strip():
                    raise ValueError(f"{self.edits_field}[{index}] of {record.get('key')!r} has no edited_caption")
            # An edit the text encoder cannot read in full would be rendered for nothing: its change lies past the
            # encoder's context (77 tokens for CLIP), so it is refused up front, with that reason.
            positions, too_long = self._split_by_length(edits)
            keep = self.options.keep_candidates
            if not positions:
                update = {self.output_field: [], self.candidates_field: too_long, **self._strength(keep, [])}
                out.append({**update, **self._cost(record, None, 0)})
                continue
            edits_in_context = [edits[i] for i in positions]
            requests = [self._request(e) for e in edits_in_context]
            with count_network_cost(editor_networks(editor)) as cost:
                sweep = editor.render(record, requests)
            with count_network_cost(self._gate_networks(), flops=False) as gates:
                chosen, candidates = selector.select(caption, edits_in_context, sweep)
            cost = cost.merged(gates, prefix="gates.")
            for sample in chosen:
                sample.setdefault("editor", self.editor_name)
            # Before edit_index is remapped below: the records are still aligned with the rendered candidates.
            series = self._strength_series(record, sweep, candidates, positions) if keep else []
            for candidate in candidates:  # index into the record's edits, not the in-context subset
                candidate["edit_index"] = positions[candidate["edit_index"]]
            candidates = sorted(candidates + too_long, key=lambda c: c["edit_index"])
            logger.debug("%s %s: %d of %d edits kept", self.name, record.get("key"), len(chosen), len(edits))
            update = {self.output_field: chosen, self.candidates_field: candidates, **self._strength(keep, series)}
            out.append({**update, **self._cost(record, cost, len(positions))})
        return out

    def _gate_networks(self) -> dict[str, Any]:
        """The networks of the CLIP gates: their forwards are part of what a kept edit costs."""
        return editor_networks(self.scorer) if self.scorer is not None else {}

    def _cost(self, record: Record, cost, rendered: int) -> dict[str, Any]:
        """The cost field of an update: the render's and gates' counted cost, and the inversion's where this stage
        consumes one (prompt-to-prompt's; the ``invert`` stage counted it). Absent when the stage records none."""
        if self.cost_field is None or self.cost_field not in self.produces:
            return {}
        inversion = record.get("inversion") if "inversion" in self.consumes else None
        return {
            self.cost_field: {
                "editor": self.editor_name,
                "edits_rendered": rendered,
                "edit": cost.to_dict() if cost is not None else None,
                "inversion": inversion.get("cost") if isinstance(inversion, dict) else None,
            }
        }

    def _strength(self, keep: bool, series: list[dict]) -> dict[str, list]:
        """The strength field of an update: present only when the option keeps candidates (otherwise the stored
        outputs are exactly those of a build without the option)."""
        return {self.strength_field: series} if keep else {}

    def _strength_series(self, record: Record, sweep, records: list[dict], positions: list[int]) -> list[dict]:
        """Every gate-passing candidate of the record's edits as ``strength`` samples (``strength.strength_samples``),
        each linked to its edit's selected sample in the ``counterfactual`` config."""
        selected = next(o for o in self.outputs if o.field == self.output_field)
        return strength_samples(
            sweep.candidates, records, positions, lambda j: selected.sample_key(record["key"], j), self.editor_name
        )


class LanceREditStage(CounterfactualEditStage):
    """``lance_r_edit``: the LANCE-R baseline's random word edits rendered like LANCE's.

    Same editor, gates and selection as ``edit``, plus the LANCE-R check that the edited image matches the new word
    (``edited_span``) better than the replaced word (``original_span``). Every edit in ``record["random_edits"]``
    is rendered (they carry no ``kept`` flag).
    """

    name = "lance_r_edit"
    consumes = {"key": "str", "caption": "str", "inversion": "dict", "random_edits": "list"}
    produces = {"lance_r": "list", "lance_r_candidates": "list"}
    outputs = (ReleaseOutput("lance_r", "lance_r", "lr", many=True, fields=(EDITOR_FIELD,)),)
    edits_field = "random_edits"
    output_field = "lance_r"
    candidates_field = "lance_r_candidates"
    strength_field = None  # the baseline's candidates are not kept: the strength config holds LANCE's edits

    @property
    def word_check(self) -> bool:  # type: ignore[override]
        return self.options.lance_r_word_check

    def _edits(self, record: Record) -> list[dict]:
        return list(record.get(self.edits_field) or [])

    def describe(self) -> dict[str, Any]:
        description = super().describe()
        description[self.editing_section]["lance_r_word_check"] = self.options.lance_r_word_check
        return description


@dataclasses.dataclass
class BenchResult:
    """What :func:`bench_edit` measured for one record."""

    edits: int
    candidates: int
    counts: Any  # the editor's own counter (each family's ``ForwardCounts``), counted from zero for this record
    seconds: float


def bench_edit(stage: CounterfactualEditStage, record: Record) -> BenchResult:
    """Run the loaded edit stage on one record with its editor counting from zero; report the edits, the candidates
    rendered, the editor's network sample-forwards (machine-independent) and this machine's wall seconds.

    For ``benchmarks/``: any family whose editor keeps a ``counts`` dataclass (ControlNet, the instruction editors).
    """
    import time

    editor = stage._require_editor()
    editor.counts = type(editor.counts)()
    start = time.perf_counter()
    result = stage.process([record])[0]
    seconds = time.perf_counter() - start
    if isinstance(result, SampleFailure):
        raise ValueError(f"bench record {record.get('key')!r} failed: {result.reason}")
    return BenchResult(len(stage._edits(record)), len(result[stage.candidates_field]), editor.counts, seconds)
