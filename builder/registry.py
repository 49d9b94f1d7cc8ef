"""The builder's registries of things chosen by name (stages, demo components, engines, sources), with lazy
``"module:attr"`` targets; the method's editors and inversion methods are re-exported from ``lance_pipeline.registry``.

The ``Registry`` class itself is :class:`lance_pipeline.registry.Registry` (re-exported here), shared with
evaluation's metrics. Registering a name never imports its target, so ``import builder`` and ``lance-cf --help``
stay fast and never pull in diffusers or transformers. An unknown name fails with a "did you mean" hint.
"""

from __future__ import annotations

# The method's own registries (editors, inversion methods) live with the method, which may not import the builder.
from lance_pipeline.registry import EDITORS, INVERSIONS, Registry
from lance_pipeline.release_kinds import list_kinds

__all__ = ["DEMO_COMPONENTS", "DISCOVERY_DEMOS", "EDITORS", "ENGINES", "INVERSIONS", "SOURCES", "STAGES", "Registry"]


# Method stages: the ``type`` of a stage in a build config. Targets live in lance_pipeline/. The screens serve every
# kind of release; each release kind adds the stages it brings (``ReleaseKind.stages``, below).
STAGES = Registry(
    "stage type",
    {
        "sensitive_edit_screen": "lance_pipeline.screening.sensitive_edits:SensitiveEditScreen",
        "sensitive_edit_screen_lance_r": "lance_pipeline.screening.sensitive_edits:LanceRSensitiveEditScreen",
        "sensitive_edit_screen_strength": "lance_pipeline.screening.sensitive_edits:StrengthSensitiveEditScreen",
        "safety_check": "lance_pipeline.screening.safety_checker:SafetyCheckStage",
        "preservation": "lance_pipeline.preservation:PreservationStage",
        "safety_check_lance_r": "lance_pipeline.screening.safety_checker:LanceRSafetyCheckStage",
        "safety_check_strength": "lance_pipeline.screening.safety_checker:StrengthSafetyCheckStage",
        "safety_check_reconstruction": "lance_pipeline.screening.safety_checker:ReconstructionSafetyCheckStage",
        "safety_check_generated": "lance_pipeline.screening.safety_checker:GeneratedSafetyCheckStage",
        "safety_check_discovery": "lance_pipeline.screening.safety_checker:DiscoverySafetyCheckStage",
        "judge": "lance_pipeline.screening.judge:JudgeStage",
        "judge_lance_r": "lance_pipeline.screening.judge:LanceRJudgeStage",
        "judge_strength": "lance_pipeline.screening.judge:StrengthJudgeStage",
        "judge_generated": "lance_pipeline.screening.judge:GeneratedJudgeStage",
        "judge_discovery": "lance_pipeline.screening.judge:DiscoveryJudgeStage",
    },
)

# Tiny random-weight components the offline ``demo`` preset materialises locally (model references ``demo:NAME``).
DEMO_COMPONENTS = Registry(
    "demo component",
    {
        "tiny-blip2": "lance_pipeline.tiny.text_components:create_tiny_blip2",
        "tiny-causal-lm": "lance_pipeline.tiny.text_components:create_tiny_causal_lm",
        "tiny-masked-lm": "lance_pipeline.tiny.text_components:create_tiny_masked_lm",
        "tiny-lora-adapter": "lance_pipeline.tiny.text_components:create_tiny_lora",
        "tiny-stable-diffusion": "lance_pipeline.tiny.image_components:create_tiny_stable_diffusion",
        "tiny-open-clip": "lance_pipeline.tiny.clip_components:create_tiny_open_clip",
        "tiny-controlnet": "lance_pipeline.tiny.controlnet_components:create_tiny_controlnet",
        "tiny-instruct-pix2pix": "lance_pipeline.tiny.instruct_components:create_tiny_instruct_pix2pix",
        "tiny-flux2-klein": "lance_pipeline.tiny.instruct_components:create_tiny_flux2_klein",
        "tiny-qwen-image-edit": "lance_pipeline.tiny.instruct_components:create_tiny_qwen_image_edit",
        "tiny-longcat-edit": "lance_pipeline.tiny.instruct_components:create_tiny_longcat_edit",
        "tiny-star-tokens": "builder.interfaces.cli:create_demo_star_tokens",
        "tiny-safety-checker": "lance_pipeline.tiny.safety_components:create_tiny_safety_checker",
        "tiny-judge": "lance_pipeline.tiny.judge_components:create_tiny_judge",
        "tiny-lpips-backbone": "lance_pipeline.tiny.preservation_components:create_tiny_lpips_backbone",
    },
)

# The offline discovery demo's planted cases: ``lance-cf discover --demo NAME``. Each target is a callable
# (class names, labels) -> DiscoveryComponents of deterministic stand-ins (lance_pipeline/tiny/discovery_components.py).
DISCOVERY_DEMOS = Registry(
    "discovery demo",
    {
        "planted-red": "lance_pipeline.tiny.discovery_components:PLANTED_RED",
        "partial-red": "lance_pipeline.tiny.discovery_components:PARTIAL_RED",
        "target-shift": "lance_pipeline.tiny.discovery_components:TARGET_SHIFT",
        "scattered-blue": "lance_pipeline.tiny.discovery_components:SCATTERED_BLUE",
        "null": "lance_pipeline.tiny.discovery_components:NULL",
        "red-and-striped": "lance_pipeline.tiny.discovery_components:RED_AND_STRIPED",
        "red-striped-rippled": "lance_pipeline.tiny.discovery_components:RED_STRIPED_RIPPLED",
    },
)

# Build engines: ``lance-cf build --engine NAME``. Each is a function of the build's run object
# (``builder.engine.BuildRun``, as ``run_local(run)``), plus keyword options (``build(engine_options=...)``);
# ``devices`` runs batches on one process per device, ``ray`` on Ray actors (extra: [ray]). docs/scaling.md.
ENGINES = Registry(
    "engine",
    {
        "local": "builder.engine:run_local",
        "devices": "builder.multi_device:run_devices",
        "ray": "builder.ray_engine:run_ray",
    },
)

# Sources: the scheme of ``--source SCHEME:ARG``; each release kind adds the sources it brings (``ReleaseKind.sources``).
SOURCES = Registry(
    "source",
    {
        "imagefolder": "builder.sources:ImageFolderSource",
        "imagenet": "builder.sources:ImageNetSource",
        "hf": "builder.sources:HFDatasetSource",
        "wds": "builder.sources:WebDatasetSource",
        "demo": "builder.sources:DemoSource",
    },
)

for _kind in list_kinds():  # the registrations each release kind declares (lance_pipeline/<system>/release_kind.py)
    for _name, _target in _kind.stages.items():
        STAGES.register(_name, _target)
    for _name, _target in _kind.sources.items():
        SOURCES.register(_name, _target)
