"""Where failure discovery departs from its paper (Wiles, Albuquerque, Gowal, arXiv 2208.08831): the table of
``lance_pipeline.deviations`` the discovery release kind lists."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lance_pipeline.deviations import Deviation, DeviationTable, Manifest


def _discovery(manifest: Manifest) -> Mapping[str, Any]:
    """What a discovery release's source recorded about the discovery (empty for an older release)."""
    found = (manifest.get("source") or {}).get("discovery")
    return found if isinstance(found, Mapping) else {}


DISCOVERY_ROWS = (
    Deviation(
        "discovery",
        "generator",
        "Imagen (internal to Google)",
        "Stable Diffusion 2 (`stabilityai/stable-diffusion-2`), Euler, 50 steps, guidance 7.5",
        "Imagen is not available; SD 2 is the open model ImageNet* generates with",
        "`discover --generator`, `--steps`",
        "the images are not the demo's stand-ins",
        lambda m: not _discovery(m).get("stand_in"),
    ),
    Deviation(
        "discovery",
        "captioner",
        "Flamingo (internal to DeepMind)",
        "BLIP-2 OPT-2.7B, label-conditioned (LANCE's captioner)",
        "Flamingo is not available; one captioner shared with LANCE",
        "`discover --captioner`",
        "the captions are not the demo's stand-ins",
        lambda m: not _discovery(m).get("stand_in"),
    ),
    Deviation(
        "discovery",
        "stand-ins",
        "real generator, captioner and classifiers",
        "deterministic stand-ins with a planted failure (a palette painter, a colour captioner, a rule classifier)",
        "the offline demo: tiny random models cannot make images whose content matters",
        "drop `--demo`",
        "the release came from `discover --demo`",
        lambda m: bool(_discovery(m).get("stand_in")),
    ),
    Deviation(
        "discovery",
        "describing failures",
        "a description per misclassified image (Figure 2); how several are combined is not given in our copy",
        "the failures of a class clustered (k-means on CLIP embeddings, all predicted labels together, k by "
        "silhouette), each cluster's captions merged into at most 3 shared keywords; one hypothesis per distinct "
        "description, at most 5 per class",
        "a short description shared by several failures is what can be tested; grouping by label first lost "
        "failures whose wrong labels scatter",
        "`discover --merge-llm MODEL` merges with an LLM; clustering and the 5 through the Python API "
        "(`ClusteringSettings`, `DiscoverySettings`)",
    ),
    Deviation(
        "discovery",
        "what counts as a failure found",
        "a description under which the rate of a (true label, predicted label) pair is higher than the base caption's "
        "(Figures 3 and 5); no significance test is given in our copy",
        "the target label's rate and the total failure rate, each a one-sided Fisher exact test against the base "
        "images; Benjamini-Hochberg over both tests of every hypothesis of a model, level 0.05",
        "a reader can check a discovery; with tens of descriptions per model, some rates rise by chance",
        "`discover --alpha`",
    ),
    Deviation(
        "discovery",
        "sample sizes",
        "not given in our copy (its rates, as low as 0.0032%, imply many thousands of images per caption)",
        "200 base images per class, 100 per description",
        "our choice: 700 generated images per class at 5 descriptions; at these sizes a shift of one wrong label from "
        "4% to 20% is found in most runs (docs/discovery.md)",
        "`discover --n-base`, `--n-test`",
    ),
    Deviation(
        "discovery",
        "refinement",
        "the description is edited word by word, by hand or automatically (Figure 2)",
        "every word-dropped variant tested on the test(s) that found the failure, against base and against the full "
        "description (one-sided Fisher exact tests, all in one Benjamini-Hochberg family of their own); the shortest "
        "variant significant against base and not significantly lower than the full description is reported beside "
        "it, both with their rates and q-values",
        "which words carry the failure is a question of its own, corrected as such; a word the failure needs takes "
        "part of the rate with it when dropped, so a variant still significant against base may not replace the "
        "description (the paper prunes to keep what the failure needs)",
        "`discover --no-refine`",
        "refinement ran",
        lambda m: _discovery(m).get("refine", True) is not False,
    ),
)


DISCOVERY_DEVIATIONS = DeviationTable(
    "discovery",
    "Failure discovery (`lance-cf discover`)",
    "Wiles, Albuquerque, Gowal, arXiv 2208.08831: section 3, Figures 2, 3 and 5 (no code was published)",
    DISCOVERY_ROWS,
)
