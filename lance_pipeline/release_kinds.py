"""Release kinds: what each mode's releases are, declared once, asked by the card, evaluation and the builder.

A mode of the tool (LANCE's edits, DILLEMA-style ControlNet regeneration, dataset interfaces, failure discovery)
makes releases of one *kind*. A :class:`ReleaseKind` declares everything the other layers need to know about such a
release, so that none of them guesses the kind from config names or stage types:

- the card: the opening paragraph (``card_intro``), an optional section of its own (``card_section``), its known
  failure modes (``card_failure_modes``), the example
  filter of "How to load" and the config that example opens (``main_config``);
- evaluation: the registered metrics that apply to this kind only (``metrics``), the sections of a results JSON that
  belong to it, each with its validator (``results_sections``), its leaderboard table (``leaderboard``; the paired
  LANCE table when ``None``) and a table of its own in each model's report (``report_section``);
- the release's metadata: the papers it implements (``papers``: citations, ``arxiv:`` tags), how its images were made
  (``making``, ``collection_type``: ``croissant.json``'s description and ``rai:`` collection fields), and the Hub's
  card keys (``generated``, ``language_creators``, ``task_ids``);
- the deviations from its papers that its card and ``croissant.json`` list (``deviations``);
- the builder: the ``next:`` commands printed after a successful build (``next_commands``), and the cost estimate of a
  full-size build on a CPU (``unet_evaluations``) and its registrations (``stages``, ``sources``, ``subcommands``);
- evaluation: the editor of a release whose stages recorded none (``editor``, for ``compare-editors``) and the lines
  ``lance-cf eval`` prints for its results (``summary_lines``).

Targets are lazy ``"module:attr"`` strings resolved by the layer that uses them (a card target lives in
``dataset_cards``, an evaluation target in ``evaluation``): this module imports nothing of theirs, so every layer can
import it (docs/architecture.md, "Release kinds"; ``tests/test_release_kinds.py`` checks that every declared target
resolves in its own layer).

A release records its kind: the builder writes it as the manifest's ``kind``, ``lance-cf eval`` as the results'
``release.kind``. Releases and results written before kinds were recorded are recognised from what they hold (the
source kind, the stage types, the editors, the configs of a results JSON); a kind that declares none of these is
recognised only when recorded, and an unrecognised release is a LANCE release, as the tool's first mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lance_pipeline.registry import Registry

DEFAULT_KIND = "lance"


@dataclass(frozen=True)
class Paper:
    """A paper a release kind implements: cited by ``croissant.json`` and the card, tagged ``arxiv:<id>`` on the Hub."""

    key: str
    arxiv: str
    title: str
    authors: tuple[str, ...]
    year: int
    venue: str | None = None  # the proceedings, when published in one

    @property
    def url(self) -> str:
        return f"https://arxiv.org/abs/{self.arxiv}"

    def bibtex(self) -> str:
        fields = [("title", self.title), ("author", " and ".join(self.authors))]
        if self.venue:
            fields.append(("booktitle", self.venue))
        fields += [("year", str(self.year)), ("eprint", self.arxiv), ("archivePrefix", "arXiv"), ("url", self.url)]
        body = ",\n".join(f"  {name:<13} = {{{value}}}" for name, value in fields)
        return f"@{'inproceedings' if self.venue else 'misc'}{{{self.key},\n{body}\n}}"


@dataclass(frozen=True)
class ReleaseKind:
    """What one mode's releases are (see the module docstring); ``name`` is its key in :data:`RELEASE_KINDS`."""

    name: str
    title: str  # a few words for messages and cards: "LANCE counterfactual edits"
    # dataset_cards target ``f(manifest: builder.release_format.Manifest, pretty_name: str) -> str``: the Markdown
    # paragraph that opens the card and says how the images were made
    card_intro: str
    # dataset_cards target ``f(manifest: dict) -> str``: a Markdown section of this kind's own ("" for none)
    card_section: str | None = None
    # dataset_cards target ``f(manifest: builder.release_format.Manifest) -> str``: the card's "Known failure modes"
    # section ("" or None for none)
    card_failure_modes: str | None = None
    # one line of Python, after ``ds = load_dataset(...)``, for the card's "How to load" (a filter on the metadata)
    load_example: str | None = None
    # the config the card's loading example and the next: hints open, when the release has it (else its first)
    main_config: str | None = None
    # registered metrics (evaluation.metric_registry.METRICS) that apply to the kinds that list them and to no other;
    # a metric that no kind lists applies to every kind (its own ``applies`` still decides)
    metrics: tuple[str, ...] = ()
    # results JSON keys that belong to this kind -> evaluation target ``f(section) -> None`` raising ValueError
    results_sections: dict[str, str] = field(default_factory=dict)
    # evaluation target: an object with ``markdown(results) -> str`` and ``write(results, output_dir, write_paired)
    # -> dict[str, Path]``; None: the paired table of evaluation.leaderboard
    leaderboard: str | None = None
    # evaluation target ``f(results) -> {"title", "note", "header", "rows"} | None``: a table of this kind's own in
    # each model's report (the interfaces' per-shift table)
    report_section: str | None = None
    # ``next:`` after a successful build; placeholders {release}, {config} (main config), {class_map}
    # (" --class-map CLASS_MAP" unless the label space is ImageNet-1k)
    next_commands: tuple[str, ...] = ()
    # The papers its releases implement, in citation order
    papers: tuple[Paper, ...] = ()
    # How its images were made, in a few sentences: croissant.json's description, rai:dataCollection and
    # rai:dataManipulationProtocol ("": a sentence naming the kind's title, and that it declared none)
    making: str = ""
    # croissant.json's rai:dataCollectionType
    collection_type: str = "Synthetic data"
    # Hub card keys: images generated from text (source_datasets "original", labels are the class asked for) rather
    # than edits of a source dataset's images; who wrote the text of the metadata; the Hub's task ids
    generated: bool = False
    language_creators: tuple[str, ...] = ("machine-generated",)
    task_ids: tuple[str, ...] = ("multi-class-image-classification",)
    # lance_pipeline targets of the ``lance_pipeline.deviations.DeviationTable``s whose rows may apply to its releases
    # (each row's own ``applies`` decides), in the order the card lists them
    deviations: tuple[str, ...] = ()
    # the editor (lance_pipeline.registry.EDITORS) of a release whose stages recorded none (evaluation.fidelity)
    editor: str | None = None
    # evaluation target ``f(results, name) -> list[str]``: lines of this kind's own that ``lance-cf eval`` prints
    # after the per-config ones (the interfaces' per-shift drops)
    summary_lines: str | None = None
    # lance_pipeline target ``f(stages) -> {stage name: UNet forward-equivalents per source image}``, ``stages`` a
    # list of (stage name, stage object, typed options) of the active stages: the cost estimate the builder gives
    # before refusing a full-size build on a CPU
    unet_evaluations: str | None = None
    # Its registrations: the stage types and source kinds it brings (name -> "module:attr", added to builder.registry's
    # STAGES and SOURCES when the builder's registries are made; a kind registered later registers its own there) and
    # its lance-cf subcommands that load models (``lance-cf models list|download`` accepts them as a target)
    stages: dict[str, str] = field(default_factory=dict)
    # lance-cf review: the metadata fields that say what a sample changes (the first one a sample has is its edit) and
    # those a blind reviewer sees besides the class and captions (what its questions need)
    review_edit_fields: tuple[str, ...] = ()
    review_fields: tuple[str, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)
    subcommands: tuple[str, ...] = ()
    # How a release whose manifest does not record its kind is recognised (any one suffices):
    source_kinds: tuple[str, ...] = ()  # the manifest's source.kind
    stage_types: tuple[str, ...] = ()  # a stage type of the build config
    editors: tuple[str, ...] = ()  # an editor a stage recorded (lance_pipeline.registry.EDITORS)
    # ... and a results JSON without release.kind: configs it scored that mark this kind (with no "original")
    results_configs: tuple[str, ...] = ()

    def recognises(self, manifest: dict[str, Any]) -> bool:
        """True when ``manifest`` (a manifest dict without a recorded kind) was made by this kind's mode."""
        source = manifest.get("source") if isinstance(manifest.get("source"), dict) else {}
        if self.source_kinds and str(source.get("kind")) in self.source_kinds:
            return True
        if self.stage_types and stage_types_of(manifest) & set(self.stage_types):
            return True
        return bool(self.editors and editors_of(manifest) & set(self.editors))

    def main_config_of(self, configs: list[str]) -> str | None:
        """The config a loading example opens: ``main_config`` when the release has it, else its first config."""
        if self.main_config is not None and self.main_config in configs:
            return self.main_config
        return configs[0] if configs else None

    def next_lines(self, release: str, manifest: dict[str, Any]) -> list[str]:
        """The ``next:`` commands for a finished release at ``release`` (a path or a Hub id)."""
        configs = list(manifest.get("configs") or [])
        space = manifest.get("label_space") if isinstance(manifest.get("label_space"), dict) else {}
        class_map = "" if space.get("name") == "imagenet-1k" else " --class-map CLASS_MAP"
        values = {"release": release, "config": self.main_config_of(configs) or "", "class_map": class_map}
        return [template.format(**values) for template in self.next_commands]


def stage_types_of(manifest: dict[str, Any]) -> set[str]:
    """The ``type`` of every stage of the manifest's build config."""
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    return {str(s.get("type")) for s in config.get("stages") or [] if isinstance(s, dict) and s.get("type")}


def editors_of(manifest: dict[str, Any]) -> set[str]:
    """Every editor name the release's stages recorded in their descriptions (an ``editor`` string at any depth)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "editor" and isinstance(value, str):
                    found.add(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(manifest.get("stages") or {})
    return found


# The modes' declarations live in their rooms (lance_pipeline/<mode>/release_kind.py); a mode of a test or a plugin
# registers its own: RELEASE_KINDS.register("my_mode", "my_package.kind:MY_MODE"). Recognition (for releases that do
# not record their kind) tries the kinds in this order.
RELEASE_KINDS = Registry(
    "release kind",
    {
        "discovery": "lance_pipeline.discovery.release_kind:DISCOVERY",
        "interfaces": "lance_pipeline.interfaces.release_kind:INTERFACES",
        "controlnet": "lance_pipeline.dillema.release_kind:CONTROLNET",
        "instruct": "lance_pipeline.instruct.release_kind:INSTRUCT",
        "lance": "lance_pipeline.editing.release_kind:LANCE",
    },
)


def get_kind(name: str) -> ReleaseKind:
    """The kind registered as ``name`` (an unknown name: one line with "did you mean")."""
    kind = RELEASE_KINDS.resolve(name)
    if not isinstance(kind, ReleaseKind) or kind.name != name:
        raise TypeError(f"release kind {name!r} resolves to {kind!r}, not a ReleaseKind named {name!r}")
    return kind


def list_kinds() -> list[ReleaseKind]:
    """Every registered kind, in recognition order."""
    return [get_kind(name) for name in RELEASE_KINDS.in_order()]


def kind_of_manifest(manifest: dict[str, Any]) -> ReleaseKind:
    """The kind of a release from its manifest dict: the recorded ``kind`` when the manifest has one (a kind this
    installation does not know is an error naming it), else recognised from what the manifest holds."""
    recorded = manifest.get("kind")
    if recorded is not None:
        if not isinstance(recorded, str) or recorded not in RELEASE_KINDS:
            raise ValueError(
                f"the release records kind {recorded!r}, which this lance-cf does not know "
                f"(known: {', '.join(RELEASE_KINDS.names())}); upgrade lance-counterfactuals or install the mode"
            )
        return get_kind(recorded)
    for kind in list_kinds():
        if kind.recognises(manifest):
            return kind
    return get_kind(DEFAULT_KIND)


def kind_of_results(results: dict[str, Any]) -> ReleaseKind:
    """The kind of the release a results JSON was computed on: ``release.kind`` when recorded (eval records it), else
    a kind whose results section the results carry, or whose marking configs were scored without ``original``."""
    release = results.get("release") if isinstance(results.get("release"), dict) else {}
    recorded = release.get("kind")
    if isinstance(recorded, str) and recorded in RELEASE_KINDS:
        return get_kind(recorded)
    if recorded is not None:
        raise ValueError(
            f"results of a release of kind {recorded!r}, which this lance-cf does not know "
            f"(known: {', '.join(RELEASE_KINDS.names())})"
        )
    configs = [str(c) for c in release.get("configs") or []]
    for kind in list_kinds():
        if any(section in results for section in kind.results_sections):
            return kind
        if kind.results_configs and "original" not in configs and set(kind.results_configs) <= set(configs):
            return kind
    return get_kind(DEFAULT_KIND)


def resolve_target(target: str) -> Any:
    """Import a kind's ``"module:attr"`` target (done by the layer the target belongs to, on use)."""
    if ":" not in target:
        raise ValueError(f"release kind target must look like 'package.module:attr', got {target!r}")
    return RELEASE_KINDS.resolve(target)


def metric_kinds(metric: str) -> list[str]:
    """The kinds that list ``metric`` as theirs (empty: the metric applies to every kind)."""
    return [kind.name for kind in list_kinds() if metric in kind.metrics]


def metric_applies_to(metric: str, kind: str | None) -> bool:
    """Whether a registered metric may apply to releases of ``kind`` (None: unknown, no restriction)."""
    owners = metric_kinds(metric)
    return kind is None or not owners or kind in owners
