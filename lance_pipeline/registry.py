"""The one registry pattern for things chosen by name, with lazy ``"module:attr"`` targets.

Registering a name never imports its target, so ``import builder``, ``lance-cf --help`` and listing what is
registered stay fast and never pull in diffusers, transformers or torch (the pattern of lm-evaluation-harness'
registries). An unknown name fails with a "did you mean" hint.

The class lives here, in the lowest layer, because every layer chooses things by name: the method itself (editors
and inversion methods, registered at the bottom of this module, since the method may not import the builder), the
builder (sources, stages, engines, demo components: ``builder/registry.py``, which re-exports the method's registries)
and evaluation (metrics: ``evaluation/metric_registry.py``), which may not import the builder either
(docs/architecture.md, "Layers"; ``tests/test_layers.py``).
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any


class Registry:
    """Names mapped to ``"package.module:attr"`` targets, resolved (imported) only on use.

    Names keep the order they were registered in (:meth:`in_order`), for registries where order means something
    (metrics run in registration order); :meth:`names` is sorted, for listings and messages.
    """

    def __init__(self, kind: str, entries: dict[str, str] | None = None):
        self.kind = kind
        self._targets: dict[str, str] = {}
        for name, target in (entries or {}).items():
            self.register(name, target)

    def register(self, name: str, target: str) -> None:
        if ":" not in target:
            raise ValueError(f"{self.kind} {name!r}: target must look like 'package.module:attr', got {target!r}")
        self._targets[name] = target

    def unregister(self, name: str) -> None:
        """Forget ``name`` (tests that register an entry of their own remove it afterwards)."""
        self.target(name)  # unknown name: the usual one-line error
        del self._targets[name]

    def __contains__(self, name: object) -> bool:
        return name in self._targets

    def names(self) -> list[str]:
        return sorted(self._targets)

    def in_order(self) -> list[str]:
        """Names in the order they were registered."""
        return list(self._targets)

    def target(self, name: str) -> str:
        if name not in self._targets:
            close = difflib.get_close_matches(name, self._targets, n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(f"unknown {self.kind} {name!r} (known: {', '.join(self.names())}){hint}")
        return self._targets[name]

    def resolve(self, name: str) -> Any:
        """The registered object; a ``package.module:attr`` name is imported directly (custom stages, sources)."""
        target = name if ":" in name else self.target(name)
        module_name, attr = target.split(":", 1)
        module = importlib.import_module(module_name)
        return getattr(module, attr)


# Image editors: what renders candidate counterfactuals of one source image (interface in
# lance_pipeline/editing/candidate_selection.py: ``Editor``). Chosen by an edit stage's ``editor_name``.
EDITORS = Registry(
    "editor",
    {
        "prompt_to_prompt": "lance_pipeline.editing.prompt_to_prompt:PromptToPromptEditor",
        "controlnet": "lance_pipeline.dillema.controlnet_editing:ControlNetEditor",
    },
)

# Inversion methods of a real image (interface: ``lance_pipeline.editing.inversion.InversionMethod``). Chosen by the image
# stages' ``inversion`` option.
INVERSIONS = Registry(
    "inversion method",
    {
        "null_text": "lance_pipeline.editing.inversion:NullTextMethod",
        "negative_prompt": "lance_pipeline.editing.inversion:NegativePromptMethod",
        "direct": "lance_pipeline.editing.inversion:DirectInversionMethod",
    },
)
