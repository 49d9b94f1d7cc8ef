"""``lance-cf ARGS`` in this process, counting how often each model is loaded: the libraries' own loading entry points
are wrapped, so every load is seen however the project reaches it.

    python tests/load_counter.py COUNTS.json [--unshared] -- build demo --output OUT ...

writes ``{"sentence-transformers": {NAME: n}, "safety-checker": {NAME: n}, "stable-diffusion-unet": {NAME: n}}``
(NAME: the last component of the path or id loaded) and exits with lance-cf's code. ``--unshared`` turns off the
sharing of ``lance_pipeline.models.shared`` (every stage loads its own copy, as before it existed), so a test can
compare both builds' bytes.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

COUNTS: dict[str, Counter] = {"sentence-transformers": Counter(), "safety-checker": Counter(),
                              "stable-diffusion-unet": Counter()}  # fmt: skip


def _name(model: object) -> str:
    return os.path.basename(str(model).rstrip("/")) or str(model)


def install_hooks() -> None:
    import sentence_transformers
    from diffusers import UNet2DConditionModel
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker

    class CountedSentenceTransformer(sentence_transformers.SentenceTransformer):
        def __init__(self, model_name_or_path=None, *args, **kwargs):
            COUNTS["sentence-transformers"][_name(model_name_or_path)] += 1
            super().__init__(model_name_or_path, *args, **kwargs)

    # The project imports the class from the package at load time, so replacing the package's attribute is enough.
    sentence_transformers.SentenceTransformer = CountedSentenceTransformer

    def counted(kind: str, original):
        def from_pretrained(cls, model, *args, **kwargs):
            COUNTS[kind][_name(model)] += 1
            return original.__func__(cls, model, *args, **kwargs)

        return classmethod(from_pretrained)

    StableDiffusionSafetyChecker.from_pretrained = counted(
        "safety-checker", StableDiffusionSafetyChecker.from_pretrained
    )
    UNet2DConditionModel.from_pretrained = counted("stable-diffusion-unet", UNet2DConditionModel.from_pretrained)


class _NoSharing(dict):
    """Stands in for ``shared_models``' map: remembers nothing, so every ``shared_model`` call loads."""

    def __setitem__(self, key, value) -> None:
        return None


def main(argv: list[str]) -> int:
    out, rest = Path(argv[0]), argv[1:]
    unshared = "--unshared" in rest[: rest.index("--")]
    args = rest[rest.index("--") + 1 :]
    install_hooks()
    if unshared:
        from lance_pipeline.models import shared as shared_models

        shared_models._SHARED = _NoSharing()
    from builder.cli import main as lance_cf

    try:
        code = lance_cf(args)
    finally:
        out.write_text(json.dumps({k: dict(sorted(v.items())) for k, v in COUNTS.items()}, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
