"""Measuring what editing costs, and the reference algorithm it is measured against.

* ``count_unet_evaluations(unet)``: counts UNet *sample-forwards* (one latent through the network; a batch of n is n)
  and the sample-backwards of null-text optimisation, with a forward hook, so the cost of an editor is exact and
  machine-independent. ``forward_equivalents`` weighs a backward w.r.t. the null embedding only as
  ``BACKWARD_FORWARD_EQUIVALENT`` forwards (0.866 of 0.803 TFLOP, measured with torch's FLOP counter on the SD 1.x
  UNet at 512², shared/reference/editing-2026.md).
* ``count_network_cost(editor_networks(editor))``: the same count for any editor, without knowing its networks: the
  sample-forwards of every ``torch.nn.Module`` the editor holds (and the backwards of forwards under gradients), and
  the FLOPs of everything run in the block (``torch.utils.flop_counter.FlopCounterMode``). The image stages record it
  per record (``invert``: in each ``inversion``; the edit stage: ``edit_cost``), whatever the editor.
* ``reference_sweep`` / ``reference_reconstruction``: the algorithm as the authors ran it, one prompt-to-prompt run
  of ``[caption, edited caption]`` per (edit, sweep value) and a separate reconstruction pass, built from the same
  primitives as the editor so tests and ``benchmarks/bench_edit.py`` can compare outputs and counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

BACKWARD_FORWARD_EQUIVALENT = 1.08


@dataclass
class UnetCount:
    """Sample-forwards (``forwards``) and sample-backwards (``backwards``) seen since the counter was installed."""

    forwards: int = 0
    backwards: int = 0

    @property
    def forward_equivalents(self) -> float:
        return self.forwards + BACKWARD_FORWARD_EQUIVALENT * self.backwards


@contextlib.contextmanager
def count_unet_evaluations(unet) -> Iterator[UnetCount]:
    """Count the UNet's sample-forwards (and the backwards that follow forwards run with gradients) in the block.

    A forward under ``torch.is_grad_enabled()`` whose inputs require gradients (null-text optimisation's) is counted
    as one forward plus one backward per sample.
    """
    import torch

    count = UnetCount()

    def hook(module, args, kwargs, output):
        sample = args[0] if args else kwargs["sample"]
        batch = int(sample.shape[0])
        count.forwards += batch
        inputs = list(args) + list(kwargs.values())
        if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
            count.backwards += batch

    handle = unet.register_forward_hook(hook, with_kwargs=True)
    try:
        yield count
    finally:
        handle.remove()


def reference_reconstruction(editor, inversion: dict[str, Any]):
    """The reconstruction as a separate guided sampling pass of the caption (what the authors ran)."""
    return editor.render_reconstruction(inversion)


def reference_sweep(editor, inversion: dict[str, Any], requests) -> dict[tuple[int, float], Any]:
    """One prompt-to-prompt run of ``[caption, edited caption]`` per (request, sweep value), nothing shared.

    Returns:
        ``(request index, sweep value) -> final latents [2, C, h, w]`` (the run's source, then the target).
    """
    # lazy: imports torch
    from lance_pipeline.editing.attention_control import PromptToPromptController

    # lazy: imports torch
    from lance_pipeline.editing.inversion import ddim_sample

    o = editor.options
    latent = inversion["latent"].to(editor.device, editor.dtype)
    nulls = inversion["null_embeddings"].to(editor.device, editor.dtype)
    caption = inversion["caption"]
    out = {}
    for index, request in enumerate(requests):
        cond = editor._embed([caption, request.edited_caption])
        for f in o.self_replace_sweep:
            target, _ = editor.build_target(caption, request, f)
            controller = PromptToPromptController([target], self_replace_max_tokens=o.self_replace_max_tokens)
            latents = ddim_sample(
                editor.components.unet,
                editor.components.scheduler_config,
                latent,
                cond,
                nulls,
                o.guidance_scale,
                controller=controller,
            )
            out[(index, f)] = latents
    return out


# ---------------------------------------------------------------------------------------------- a build's estimate
# A build's active stages as the estimate sees them: (stage name, stage type, typed options, a function making the
# stage object, nothing loaded).
PlannedStage = tuple[str, str, Any, Callable[[], Any]]


def edits_per_image(stages: list[PlannedStage]) -> int:
    """Edits the perturb stage asks for per source image (``n_per_type`` x edit types, before the label check drops
    any); 0 without one."""
    for _name, kind, options, create in stages:
        if kind == "llm_perturber":
            return len(create().edit_types) * options.n_per_type
    return 0


def unet_evaluations(stages: list[PlannedStage], edits: int | None = None) -> dict[str, float]:
    """UNet forward-equivalents per source image of LANCE's image stages (``ReleaseKind.unet_evaluations``).

    The counts follow docs/performance.md ("At the issue's scale", counted with :func:`count_unet_evaluations`):
    null-text inversion runs S steps with I optimisation iterations each (S x (4 + 2.08 I)); prompt-to-prompt renders
    each edit as a trunk and forked branches (6 S per edit with guidance) plus a source row of 2 S per sampling run;
    the reconstruction one guided pass (2 S); LANCE-R one edit. ``edits`` per image default to the perturb stage's.
    Text stages are left out (under 1 % of editing, docs/performance.md).
    """
    edits = edits_per_image(stages) if edits is None else edits
    counts: dict[str, float] = {}
    for name, kind, options, _create in stages:
        steps = getattr(options, "num_inference_steps", None)
        if not steps:
            continue
        if kind == "null_text_inversion":
            inner = getattr(options, "num_inner_steps", 0) if options.inversion == "null_text" else 0
            counts[name] = steps * (4 + (1 + BACKWARD_FORWARD_EQUIVALENT) * inner) if inner else steps
        elif kind == "reconstruction":
            counts[name] = 2 * steps
        elif kind == "prompt_to_prompt_edit":
            counts[name] = edits * 6 * steps + 2 * steps * max(1, -(-edits // 10))
        elif kind == "lance_r_edit":
            counts[name] = 6 * steps + 2 * steps
    return counts


# ---------------------------------------------------------------------------------------------- any editor's cost


@dataclass
class NetworkCost:
    """What one block of editing cost, counted by hooks: sample-forwards (and the sample-backwards of forwards run
    with gradients) of each network the editor holds, and the FLOPs of every operation torch's FLOP counter knows
    (matrix products, convolutions, attention), forward and backward."""

    forwards: dict[str, int]
    backwards: dict[str, int]
    flops: int = 0

    @property
    def forward_equivalents(self) -> float:
        return sum(self.forwards.values()) + BACKWARD_FORWARD_EQUIVALENT * sum(self.backwards.values())

    def merged(self, other: NetworkCost, prefix: str) -> NetworkCost:
        """This count and ``other``'s (its networks' names prefixed), FLOPs added."""
        return NetworkCost(
            {**self.forwards, **{prefix + k: v for k, v in other.forwards.items()}},
            {**self.backwards, **{prefix + k: v for k, v in other.backwards.items()}},
            self.flops + other.flops,
        )

    def to_dict(self, share: float = 1.0) -> dict[str, Any]:
        """JSON for a stage's update; ``share``: the part of the block charged to one record (1/n of a batch)."""
        return {
            "forwards": {k: round(v * share, 6) for k, v in sorted(self.forwards.items()) if v},
            "backwards": {k: round(v * share, 6) for k, v in sorted(self.backwards.items()) if v},
            "forward_equivalents": round(self.forward_equivalents * share, 6),
            "flops": round(self.flops * share, 3),
        }


def editor_networks(editor: Any, depth: int = 2) -> dict[str, Any]:
    """The ``torch.nn.Module``s an editor holds, by attribute path (``components.unet``, ``controlnet``), found in its
    attributes and theirs down to ``depth``; a module inside another one found is left out (counted with it)."""
    import torch

    found: dict[str, Any] = {}
    seen: set[int] = set()

    def walk(obj: Any, prefix: str, level: int) -> None:
        if level > depth or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            return
        if isinstance(obj, torch.nn.Module):
            if id(obj) not in seen:
                seen.add(id(obj))
                found[prefix] = obj
            return
        attributes = vars(obj) if hasattr(obj, "__dict__") else {}
        if dataclasses.is_dataclass(obj) and not attributes:
            attributes = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        for name, value in sorted(attributes.items()):
            if not name.startswith("__"):
                walk(value, f"{prefix}.{name}" if prefix else name, level + 1)

    walk(editor, "", 0)
    inner = {id(m) for module in found.values() for m in list(module.modules())[1:]}
    return {name: module for name, module in sorted(found.items()) if id(module) not in inner}


def _composite_formulas() -> dict[Any, Callable]:
    """FLOPs of the composite operations that reach a dispatch mode undecomposed under ``torch.inference_mode``
    (which diffusers' pipelines enter), where autograd would otherwise have split them into ``addmm``, ``convolution``
    and the attention kernels the counter's registry knows. Counted from shapes, so the operation itself runs as it
    would without the counter (decomposing it instead changed the demo's bytes)."""
    import math

    import torch
    from torch.utils.flop_counter import conv_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def linear(x, weight, bias=None, *, out_val):
        return 2 * out_val.numel() * weight.shape[-1]

    def matmul(a, b, *, out_val):
        return 2 * out_val.numel() * a.shape[-1]

    def conv(x, weight, bias=None, *args, out_val, transposed=False):
        return conv_flop_count(list(x.shape), list(weight.shape), list(out_val.shape), transposed=transposed)

    def conv_transpose(x, weight, bias=None, *args, out_val):
        return conv(x, weight, bias, out_val=out_val, transposed=True)

    def attention(q, k, v, *args, out_val, **kwargs):
        batch = math.prod(q.shape[:-2])
        heads_shape = (batch, 1, q.shape[-2], q.shape[-1])
        return sdpa_flop_count(heads_shape, (batch, 1, *k.shape[-2:]), (batch, 1, *v.shape[-2:]))

    return {
        aten.linear: linear,
        aten.matmul: matmul,
        aten.conv1d: conv,
        aten.conv2d: conv,
        aten.conv3d: conv,
        aten.conv_transpose1d: conv_transpose,
        aten.conv_transpose2d: conv_transpose,
        aten.scaled_dot_product_attention: attention,
        # the CPU kernel SDPA dispatches to outside inference mode (the registry has the CUDA kernels' formulas)
        aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, out_val, **kw: attention(
            q, k, v, out_val=out_val
        ),
    }


class _NestedTensors(Exception):
    """An argument holds tensors below its first level: :func:`_flop_formulas` leaves its shapes to torch's wrapper."""


def _shapes(value: Any) -> Any:
    """``value`` with each tensor replaced by its shape, one level into lists and tuples: what torch's
    ``flop_counter.shape_wrapper`` makes of an operation's arguments with ``tree_map``, without walking them as a tree
    (on the demo's tiny UNet the walk was about a seventh of what counting cost)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.shape
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        if not any(isinstance(item, (torch.Tensor, list, tuple, dict)) for item in value):
            return value  # sizes, strides, flags: the walk would rebuild the same values
        if type(value) not in (list, tuple) or any(isinstance(item, (list, tuple, dict)) for item in value):
            raise _NestedTensors
        return type(value)(item.shape if isinstance(item, torch.Tensor) else item for item in value)
    if isinstance(value, dict):
        raise _NestedTensors
    return value


@functools.cache
def _flop_formulas() -> dict[Any, Callable]:
    """Operation (overload packet) -> ``formula(args, kwargs, out) -> FLOPs``: torch's FLOP counter's registry
    (``FlopCounterMode.flop_registry``: matrix products, convolutions, attention kernels, forward and backward), its
    formulas called on the shapes :func:`_shapes` takes, and :func:`_composite_formulas`."""
    from torch.utils.flop_counter import FlopCounterMode

    def on_shapes(wrapped: Callable) -> Callable:
        raw = getattr(wrapped, "__wrapped__", None)
        if raw is None:  # registered raw (``get_raw=True``): it reads the tensors itself
            return lambda args, kwargs, out: wrapped(*args, **kwargs, out_val=out)

        def formula(args: tuple, kwargs: dict, out: Any) -> int:
            try:
                shaped = [_shapes(arg) for arg in args]
                named = {name: _shapes(arg) for name, arg in kwargs.items()}
                out_shape = _shapes(out)
            except _NestedTensors:
                return wrapped(*args, **kwargs, out_val=out)
            return raw(*shaped, out_shape=out_shape, **named)

        return formula

    formulas = {packet: on_shapes(f) for packet, f in FlopCounterMode(display=False).flop_registry.items()}
    for packet, f in _composite_formulas().items():
        formulas.setdefault(packet, lambda args, kwargs, out, f=f: f(*args, **kwargs, out_val=out))
    return formulas


def _flop_count_mode():
    """A dispatch mode that adds up the FLOPs of every operation :func:`_flop_formulas` has a formula for; every
    operation runs unchanged. ``FlopCounterMode`` itself is not used: its module tracker hooks autograd and breaks
    ``torch.autograd.grad`` (the null-text optimisation's)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    formulas = _flop_formulas()

    class FlopCount(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.flops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = formulas.get(func._overloadpacket)
            if formula is not None:
                self.flops += int(formula(args, kwargs, out))
            return out

    return FlopCount()


@contextlib.contextmanager
def count_network_cost(networks: dict[str, Any], flops: bool = True) -> Iterator[NetworkCost]:
    """Count the sample-forwards of each of ``networks`` (name -> module: the batch size of its first tensor input per
    call; a call under gradients whose inputs require them also counts its backward) and, with ``flops``, every FLOP
    of the block (:func:`_flop_count_mode`). Counting changes none of these networks' results (the demo's images are
    byte-identical with and without it); it is kept off the CLIP gates (``flops=False``) because a dispatch mode
    switches off ``nn.MultiheadAttention``'s fused path, which moves open_clip's scores in the last bits."""
    import torch

    cost = NetworkCost(dict.fromkeys(networks, 0), dict.fromkeys(networks, 0))

    def hook_for(name: str) -> Callable:
        def hook(module, args, kwargs, output):
            tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
            batch = int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else 1
            cost.forwards[name] += batch
            if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
                cost.backwards[name] += batch

        return hook

    handles = [m.register_forward_hook(hook_for(n), with_kwargs=True) for n, m in networks.items()]
    counter = _flop_count_mode() if flops else None
    try:
        with counter if counter is not None else contextlib.nullcontext():
            yield cost
    finally:
        for handle in handles:
            handle.remove()
        cost.flops = counter.flops if counter is not None else 0
