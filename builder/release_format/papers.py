"""The papers each kind of release implements: cited by ``croissant.json``, tagged ``arxiv:<id>`` in the card's YAML
(the Hub links such a tag to the paper's page) and listed in the card's citation section.

A release's kind is the manifest's recorded ``kind`` when it has one; a manifest without it is recognised from its
source and stage types (discovery and generation sources, ControlNet editing), as the card recognised it before kinds
were recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

from builder.release_format.manifest import Manifest


@dataclass(frozen=True)
class Paper:
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


LANCE = Paper(
    "prabhu2023lance",
    "2305.19164",
    "LANCE: Stress-testing Visual Models by Generating Language-guided Counterfactual Images",
    ("Prabhu, Viraj", "Yenamandra, Sriram", "Chattopadhyay, Prithvijit", "Hoffman, Judy"),
    2023,
    "Advances in Neural Information Processing Systems (NeurIPS)",
)
DATASET_INTERFACES = Paper(
    "vendrow2023dataset",
    "2302.07865",
    "Dataset Interfaces: Diagnosing Model Failures Using Controllable Counterfactual Generation",
    ("Vendrow, Joshua", "Jain, Saachi", "Engstrom, Logan", "Madry, Aleksander"),
    2023,
)
DILLEMA = Paper(
    "baresi2025dillema",
    "2502.04378",
    "DILLEMA: Diffusion and Large Language Models for Multi-Modal Augmentation",
    ("Baresi, Luciano", "Hu, Davide Yi Xian", "Mas'udi, Muhammad Irfan", "Quattrocchi, Giovanni"),
    2025,
)
WILES = Paper(
    "wiles2022discovering",
    "2208.08831",
    "Discovering Bugs in Vision Models using Off-the-shelf Image Generation and Captioning",
    ("Wiles, Olivia", "Albuquerque, Isabela", "Gowal, Sven"),
    2022,
)
# A ControlNet release regenerates images DILLEMA's way inside LANCE's pipeline (its label check and CLIP gates).
KIND_PAPERS: dict[str, tuple[Paper, ...]] = {
    "lance": (LANCE,),
    "controlnet": (DILLEMA, LANCE),
    "interfaces": (DATASET_INTERFACES,),
    "discovery": (WILES,),
}


def release_kind_name(manifest: Manifest) -> str:
    """The release's kind: recorded in the manifest (``kind``), else recognised as the card did before."""
    recorded = manifest.extra.get("kind")
    if isinstance(recorded, str) and recorded:
        return recorded
    stage_types = {str(s.get("type")) for s in manifest.config.get("stages") or [] if isinstance(s, dict)}
    source_kind = str(manifest.source.get("kind"))
    if source_kind == "discovery":
        return "discovery"
    if source_kind == "generate" or "shift_generation" in stage_types:
        return "interfaces"
    if "controlnet_edit" in stage_types:
        return "controlnet"
    return "lance"


def release_papers(manifest: Manifest) -> tuple[Paper, ...]:
    """The papers the release's kind implements (LANCE's for a kind this table does not know)."""
    return KIND_PAPERS.get(release_kind_name(manifest), (LANCE,))
