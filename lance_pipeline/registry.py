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
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ModuleNotFoundError, AttributeError) as err:
            moved = MOVED_MODULES.get(module_name)
            if moved is None or (isinstance(err, ModuleNotFoundError) and err.name != module_name):
                raise
            raise ValueError(f"{target!r}: module {module_name} moved to {moved}; write {moved}:{attr}") from None


# Modules that moved when each system got a folder of its own: a ``module:attr`` target naming the old place
# gets a one-line error naming the new one (configs that name stages by registered type never notice).
MOVED_MODULES = {
    "builder.cli_discover": "builder.discovery.cli",
    "builder.cli_interfaces": "builder.interfaces.cli",
    "builder.cli_perturber": "builder.perturber.cli",
    "builder.discover": "builder.discovery.run",
    "builder.discovery_report": "builder.discovery.report",
    "builder.discovery_source": "builder.discovery.source",
    "builder.generated_source": "builder.interfaces.source",
    "evaluation.interfaces": "evaluation.interfaces.shift_results",
    "evaluation.shift_metrics": "evaluation.interfaces.shift_metrics",
    "lance_pipeline.attention_control": "lance_pipeline.editing.attention_control",
    "lance_pipeline.candidate_selection": "lance_pipeline.editing.candidate_selection",
    "lance_pipeline.captioning": "lance_pipeline.text.captioning",
    "lance_pipeline.clip_gates": "lance_pipeline.clip.gates",
    "lance_pipeline.clip_loader": "lance_pipeline.clip.loader",
    "lance_pipeline.controlnet_editing": "lance_pipeline.dillema.controlnet_editing",
    "lance_pipeline.dillema_text": "lance_pipeline.dillema.text_stages",
    "lance_pipeline.discovery": "lance_pipeline.discovery.method",
    "lance_pipeline.edit_spans": "lance_pipeline.text.edit_spans",
    "lance_pipeline.editing_cost": "lance_pipeline.editing.cost",
    "lance_pipeline.editing_options": "lance_pipeline.editing.options",
    "lance_pipeline.generation": "lance_pipeline.interfaces.generation",
    "lance_pipeline.image_editing": "lance_pipeline.editing.stages",
    "lance_pipeline.inversion": "lance_pipeline.editing.inversion",
    "lance_pipeline.label_checks": "lance_pipeline.text.label_checks",
    "lance_pipeline.perturbation": "lance_pipeline.text.perturbation",
    "lance_pipeline.perturber_collect": "lance_pipeline.perturber.collect",
    "lance_pipeline.perturber_training": "lance_pipeline.perturber.training",
    "lance_pipeline.prompt_to_prompt": "lance_pipeline.editing.prompt_to_prompt",
    "lance_pipeline.random_edits": "lance_pipeline.text.random_edits",
    "lance_pipeline.sd_components": "lance_pipeline.editing.sd_components",
    "lance_pipeline.shifts": "lance_pipeline.interfaces.shifts",
    "lance_pipeline.textual_inversion": "lance_pipeline.interfaces.textual_inversion",
    "lance_pipeline.tiny_clip_components": "lance_pipeline.tiny.clip_components",
    "lance_pipeline.tiny_controlnet_components": "lance_pipeline.tiny.controlnet_components",
    "lance_pipeline.tiny_discovery_components": "lance_pipeline.tiny.discovery_components",
    "lance_pipeline.tiny_image_components": "lance_pipeline.tiny.image_components",
    "lance_pipeline.tiny_text_components": "lance_pipeline.tiny.text_components",
}

# Image editors: what renders candidate counterfactuals of one source image (interface in
# lance_pipeline/editing/candidate_selection.py: ``Editor``). Chosen by an edit stage's ``editor_name``.
EDITORS = Registry(
    "editor",
    {
        "prompt_to_prompt": "lance_pipeline.editing.prompt_to_prompt:PromptToPromptEditor",
        "controlnet": "lance_pipeline.dillema.controlnet_editing:ControlNetEditor",
        # the instruction editors: one class, one name per family (lance_pipeline.instruct.editing.FAMILIES)
        "instruct_pix2pix": "lance_pipeline.instruct.editing:InstructEditor",
        "flux2_klein": "lance_pipeline.instruct.editing:InstructEditor",
        "longcat_edit": "lance_pipeline.instruct.editing:InstructEditor",
        "longcat_edit_turbo": "lance_pipeline.instruct.editing:InstructEditor",
        "qwen_image_edit": "lance_pipeline.instruct.editing:InstructEditor",
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
