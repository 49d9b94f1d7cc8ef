"""Preservation (lance_pipeline/preservation.py): each measure against an independent computation, LPIPS against the
lpips package's own loading of its weights, the stage on records of two editors, and one-line refusals."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.ndimage import gaussian_filter

from lance_pipeline import preservation as pv
from lance_pipeline.stage import SAMPLE_INDEX
from lance_pipeline.tiny.preservation_components import create_tiny_lpips_backbone


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    return create_tiny_lpips_backbone(tmp_path_factory.mktemp("vgg"))


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)
    b = a.copy()
    b[10:30, 8:30] = rng.integers(0, 256, (20, 22, 3), dtype=np.uint8)  # an edit inside the "object"
    b[40:, :] = np.clip(b[40:, :].astype(int) + 9, 0, 255).astype(np.uint8)  # and a little outside it
    mask = np.zeros((48, 40), np.uint8)
    mask[8:32, 6:32] = 255
    return Image.fromarray(a), Image.fromarray(b), mask


def _ssim_map(x, y):
    """Wang et al. 2004 with a Gaussian window (sigma 1.5, truncated at 3.5 sigma), population statistics."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2

    def blur(a):
        return gaussian_filter(a, sigma=1.5, truncate=3.5, mode="reflect")

    mx, my = blur(x), blur(y)
    vx, vy, cov = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
    return ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))


def test_psnr_and_ssim_equal_an_independent_computation(images):
    a, b, mask = images
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert pv.psnr(a, b) == pytest.approx(10 * math.log10(255**2 / ((x - y) ** 2).mean()), abs=1e-9)
    background = mask == 0
    mse_out = ((x - y) ** 2)[background].mean()
    assert pv.psnr(a, b, mask) == pytest.approx(10 * math.log10(255**2 / mse_out), abs=1e-9)
    maps = np.stack([_ssim_map(x[..., c], y[..., c]) for c in range(3)], axis=2).mean(axis=2)
    p = pv.SSIM_BORDER
    assert pv.ssim(a, b) == pytest.approx(maps[p:-p, p:-p].mean(), abs=1e-6)
    assert pv.ssim(a, b, mask) == pytest.approx(maps[p:-p, p:-p][background[p:-p, p:-p]].mean(), abs=1e-6)
    # the edit is mostly inside the object: outside, the images are closer
    assert pv.psnr(a, b, mask) > pv.psnr(a, b) and pv.ssim(a, b, mask) > pv.ssim(a, b)
    # identical pixels: PSNR is infinite, recorded as None; SSIM is 1; a mask that is all object leaves nothing
    assert pv.psnr(a, a) is None and pv.ssim(a, a) == pytest.approx(1.0)
    assert pv.psnr(a, b, np.ones_like(mask)) is None and pv.ssim(a, b, np.ones_like(mask)) is None


def test_the_bundled_linear_weights_are_the_lpips_packages_own(tmp_path):
    import lpips
    from safetensors.torch import load_file

    source = os.path.join(os.path.dirname(lpips.__file__), "weights", "v0.1", "vgg.pth")
    converted = load_file(str(pv.convert_lpips_linear_weights(source, tmp_path / "lin.safetensors")))
    bundled = load_file(str(pv.LPIPS_LINEAR_WEIGHTS))
    assert sorted(converted) == sorted(bundled) == [f"lin{k}.model.1.weight" for k in range(5)]
    for name in bundled:
        assert torch.equal(converted[name], bundled[name])


@pytest.mark.slow
def test_lpips_equals_the_lpips_package_with_its_own_weights(backbone, images):
    import lpips

    a, b, mask = images
    ours = pv.Lpips(str(backbone), None, "cpu")
    (whole, spatial), (same, _) = ours.distances([(a, b), (a, a)])
    # the reference: the package loading its own .pth linear weights, with the same backbone tensors
    reference = lpips.LPIPS(net="vgg", version="0.1", pnet_rand=True, verbose=False)
    reference.net.load_state_dict(ours.model.net.state_dict())

    def tensor(image):
        return torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float() / 127.5 - 1

    with torch.no_grad():
        expected = float(reference(tensor(a), tensor(b)))
        # The package's spatial map from the same model: LPIPS(spatial=True) only stores the flag its forward reads,
        # so one reference serves both (a second one built torchvision's whole random VGG16, 138M weights, again).
        reference.spatial = True
        expected_map = reference(tensor(a), tensor(b))[0, 0].numpy()
    assert whole == pytest.approx(expected, rel=1e-5) and whole > 0
    assert same == pytest.approx(0.0, abs=1e-7)
    np.testing.assert_allclose(spatial, expected_map, rtol=1e-4, atol=1e-7)
    values = pv.measure([(a, b, mask)], ours)[0]
    assert values["preservation_lpips_outside"] == pytest.approx(float(expected_map[mask == 0].mean()), abs=2e-6)
    assert values["preservation_lpips"] == pytest.approx(expected, abs=2e-6)


def test_the_stage_adds_the_fields_to_every_editors_counterfactuals(backbone, images, tmp_path):
    a, b, mask = images
    masks = tmp_path / "masks"
    masks.mkdir()
    Image.fromarray(mask).save(masks / "src_a.png")
    stage = pv.PreservationStage(lpips_backbone=str(backbone), revision=None, masks=str(masks))
    stage.load("cpu")
    items = [
        {"image": b, "editor": "prompt_to_prompt", "edit_type": "background"},
        {"image": a, "editor": "controlnet", "edit_type": "weather", SAMPLE_INDEX: 3},
    ]
    records = [
        {"key": "src_a", "image": a, "counterfactuals": items},
        {"key": "src_b", "image": a, "counterfactuals": [{"image": b, "editor": "controlnet", "edit_type": "weather"}]},
        {"key": "src_c", "image": a, "counterfactuals": []},
    ]
    updates = stage.process(records)
    first, second = updates[0]["counterfactuals"]
    assert first["preservation_psnr"] == pytest.approx(round(pv.psnr(a, b), 6))
    assert first["preservation_psnr_outside"] == pytest.approx(round(pv.psnr(a, b, mask), 6))
    assert first["preservation_lpips_outside"] is not None and first[SAMPLE_INDEX] == 0
    assert second["preservation_psnr"] is None and second["preservation_ssim"] == 1.0 and second[SAMPLE_INDEX] == 3
    no_mask = updates[1]["counterfactuals"][0]
    assert no_mask["preservation_ssim"] == first["preservation_ssim"]
    assert [no_mask[f] for f in ("preservation_lpips_outside", "preservation_psnr_outside")] == [None, None]
    assert updates[2]["counterfactuals"] == [] and updates[2]["edit_accounting"]["by_edit_type"] == {}
    summary = pv.PreservationStage.summarize(updates)
    assert summary["measured"] == 3 and summary["kind"] == "preservation"
    controlnet = summary["by_editor"]["controlnet"]["weather"]
    assert controlnet["n"] == 2 and controlnet["preservation_ssim"] == pytest.approx(
        (1.0 + first["preservation_ssim"]) / 2, abs=1e-6
    )
    assert controlnet["preservation_psnr"] == pytest.approx(first["preservation_psnr"])  # the identical pair is null


def test_bad_inputs_are_one_line(tmp_path, backbone):
    with pytest.raises(ValueError, match="masks .* is not a directory"):
        pv.PreservationStage(masks=str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no model.safetensors"):
        pv.Lpips(str(empty), None, "cpu")
    other = tmp_path / "other"
    other.mkdir()
    from safetensors.torch import save_file

    save_file({"features.0.weight": torch.zeros(3, 3, 3, 3)}, str(other / "model.safetensors"))
    with pytest.raises(ValueError, match="not VGG16's features"):
        pv.Lpips(str(other), None, "cpu")
    with pytest.raises(ValueError, match="object mask is"):
        pv.psnr(Image.new("RGB", (8, 8)), Image.new("RGB", (8, 8)), np.zeros((4, 4)))


def test_network_cost_counts_forwards_backwards_and_flops_and_changes_no_result():
    from lance_pipeline.editing.cost import BACKWARD_FORWARD_EQUIVALENT, count_network_cost, editor_networks

    torch.manual_seed(0)

    class Editor:  # networks found in the editor's attributes and theirs; the inner layer counts with its network
        def __init__(self):
            self.components = type("C", (), {})()
            self.components.unet = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 2, 1))
            self.text = torch.nn.Linear(8, 6)
            self.name = "x"

    editor = Editor()
    networks = editor_networks(editor)
    assert sorted(networks) == ["components.unet", "text"]
    x, tokens = torch.randn(2, 3, 10, 10), torch.randn(5, 8)
    with torch.inference_mode():
        expected = (editor.components.unet(x), editor.text(tokens))
    # conv 3->4 (3x3) on 8x8 outputs, conv 4->2 (1x1), linear 8->6: 2 FLOPs per multiply-add
    conv_flops = 2 * (2 * 4 * 8 * 8 * 3 * 9) + 2 * (2 * 2 * 8 * 8 * 4)
    linear_flops = 2 * 5 * 8 * 6
    for mode in (torch.inference_mode, torch.no_grad):  # diffusers' pipelines run in inference mode
        with count_network_cost(networks) as cost, mode():
            got = (editor.components.unet(x), editor.text(tokens))
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert cost.forwards == {"components.unet": 2, "text": 5} and cost.flops == conv_flops + linear_flops
    # a forward under gradients (null-text optimisation's) also counts its backward
    embedding = torch.randn(3, 8, requires_grad=True)
    with count_network_cost({"text": editor.text}) as cost:
        (grad,) = torch.autograd.grad(editor.text(embedding).sum(), embedding)
    assert cost.forwards == cost.backwards == {"text": 3}
    assert cost.forward_equivalents == pytest.approx(3 + BACKWARD_FORWARD_EQUIVALENT * 3)
    assert cost.flops == 2 * (2 * 3 * 8 * 6)  # forward and the input gradient
    with count_network_cost({"text": editor.text}, flops=False) as cost:
        editor.text(tokens)
    assert cost.flops == 0 and cost.forwards == {"text": 5}


def test_network_cost_counts_what_torchs_flop_counter_counts_forward_and_backward():
    """The counter calls the formulas of torch's FLOP counter on shapes it takes itself (cheaper than torch's tree
    walk): on products, batched products and strided, padded convolutions, forward and backward, it counts what
    ``FlopCounterMode`` counts. (Attention on the CPU is counted by the counter's own formula: torch's has none.)"""
    from torch.utils.flop_counter import FlopCounterMode

    from lance_pipeline.editing.cost import count_network_cost

    torch.manual_seed(0)
    conv, linear = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.nn.Linear(16, 8)
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    a, b, bias = torch.randn(3, 5, 6, requires_grad=True), torch.randn(3, 6, 7), torch.randn(3, 5, 7)

    def work():
        features = linear(conv(x).flatten(1)[:, :16])
        products = torch.bmm(a, b) + torch.baddbmm(bias, a, b) + torch.mm(a[0], b[0])
        (features.sum() + products.sum()).backward()

    with FlopCounterMode(display=False) as torchs:
        work()
    counted = {str(op) for op in torchs.get_flop_counts()["Global"]}
    assert {"aten.convolution", "aten.convolution_backward", "aten.addmm", "aten.mm", "aten.bmm"} <= counted, counted
    assert "aten.baddbmm" in counted, counted
    with count_network_cost({}) as ours:
        work()
    assert ours.flops == torchs.get_total_flops() > 0


def test_gates_and_cost_per_editor_and_edit_type_reach_the_manifest_record():
    candidates = [  # edit 0 (subject): two sweep candidates, one chosen; edit 1 (weather): none passed
        {"edit_index": 0, "edit_type": "subject", "chosen": False},
        {"edit_index": 0, "edit_type": "subject", "chosen": True},
        {"edit_index": 1, "edit_type": "weather", "chosen": False},
    ]
    cost = {
        "editor": "prompt_to_prompt",
        "edit": {"forward_equivalents": 30.0, "flops": 3e9},
        "inversion": {"forward_equivalents": 10.0, "flops": 1e9},
    }
    account = pv.edit_accounting(candidates, cost)
    assert account["by_edit_type"] == {
        "subject": {"edits": 1, "edits_kept": 1, "forward_equivalents": 20.0, "flops": 2e9},
        "weather": {"edits": 1, "edits_kept": 0, "forward_equivalents": 20.0, "flops": 2e9},
    }
    other = pv.edit_accounting([{"edit_index": 0, "edit_type": "subject", "chosen": True}], {**cost, "inversion": None})
    items = [{"editor": "prompt_to_prompt", "edit_type": "subject", "preservation_lpips": 0.2}]
    summary = pv.PreservationStage.summarize(
        [{"counterfactuals": items, "edit_accounting": account}, {"counterfactuals": [], "edit_accounting": other}]
    )
    subject = summary["by_editor"]["prompt_to_prompt"]["subject"]
    assert (subject["edits"], subject["edits_kept"], subject["forward_equivalents"]) == (2, 2, 50.0)
    assert summary["by_editor"]["prompt_to_prompt"]["all"]["edits"] == 3
    assert summary["by_editor"]["prompt_to_prompt"]["weather"]["n"] == 0  # rendered, none kept: still accounted

    from evaluation.fidelity import fidelity_table

    manifest = {"screening": {"preservation": summary}}
    rows = [
        {"editor": "prompt_to_prompt", "release": "r", "edit_type": "subject", "judge_class_p": p, "lpips": 0.2}
        for p in (0.9, 0.4, None)
    ]
    for row in rows:
        row.update({c: None for c in ("clip_image", "edge_ssim", "background_psnr")})

    def subject_row(m):
        return next(r for r in fidelity_table(rows, None, {"r": m}) if r["edit_type"] == "subject")

    row = subject_row({**manifest, "judge_calibration": {"threshold": 0.5}})
    assert row["gate_kept"] == 1.0 and row["label_kept"] == 0.5  # 1 of the 2 judged at >= 0.5
    assert row["forward_equivalents_per_kept"] == 25.0 and row["tflops_per_kept"] == pytest.approx(2.5e9 / 1e12)
    assert row["lpips"] == pytest.approx(0.2)
    assert subject_row(manifest)["label_kept"] == "not calibrated"
    for row in rows:
        row["judge_class_p"] = None
    assert subject_row({**manifest, "judge_calibration": {"threshold": 0.5}})["label_kept"] == "not judged"
    assert subject_row({})["gate_kept"] is None  # a release built without the preservation stage
    # a record whose edit stage recorded no cost (an earlier version's build resumed): the cost is unknown, not lower
    uncounted = pv.edit_accounting(
        [{"edit_index": 0, "edit_type": "subject", "chosen": True}], None, [{"editor": "prompt_to_prompt"}]
    )
    assert uncounted["counted"] is False and uncounted["editor"] == "prompt_to_prompt"
    partial = pv.PreservationStage.summarize([{"edit_accounting": account}, {"edit_accounting": uncounted}])
    subject = partial["by_editor"]["prompt_to_prompt"]["subject"]
    assert (subject["edits"], subject["edits_kept"]) == (2, 2) and subject["forward_equivalents"] is None
    row = subject_row({"screening": {"preservation": partial}})
    assert row["gate_kept"] == 1.0 and row["forward_equivalents_per_kept"] is None and row["tflops_per_kept"] is None
