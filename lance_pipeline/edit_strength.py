"""Edit strength, the axis of the ``strength`` release config, defined once for the method and for evaluation.

LANCE (Prabhu et al., NeurIPS 2023, section 3.2) renders each edit once per self-attention injection fraction
``self_replace`` of a sweep (0.4 to 0.9): the fraction of the denoising steps during which the source image's
self-attention maps are injected into the edited branch; larger keeps more of the source. The strength of a candidate
is ``1 - self_replace``, rounded to 10 decimals (so that ``1 - 0.7`` is ``0.3``): the fraction of the steps in which
the edited branch's self-attention runs free of the source's. Larger is a stronger edit; the paper's sweep gives
0.1 to 0.6. The edit stage keeps such series as the ``strength`` config (``lance_pipeline.editing.strength``);
``lance-cf eval`` measures accuracy along it (``evaluation.strength``).
"""

from __future__ import annotations

STRENGTH_CONFIG = "strength"
STRENGTH_DEFINITION = "strength = 1 - self_replace (fraction of the steps without the source's self-attention)"


def strength_of(self_replace: float) -> float:
    """The strength of a candidate rendered with self-attention injection fraction ``self_replace``."""
    if isinstance(self_replace, bool) or not isinstance(self_replace, int | float) or not 0.0 <= self_replace <= 1.0:
        raise ValueError(f"self_replace must be a fraction in [0, 1], got {self_replace!r}")
    return round(1.0 - float(self_replace), 10)
