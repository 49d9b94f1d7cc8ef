"""The discovery report: its plot keeps every label inside the figure, and every text from a model, caption or class
name reaches the page escaped (Jinja2 autoescape)."""

from __future__ import annotations

import pytest

from builder.discovery.report import rates_figure, write_discovery_report


def _test(rate: float, base_count: int = 20, n: int = 100) -> dict:
    return {"count": round(rate * n), "n": n, "rate": rate, "interval": (max(0.0, rate - 0.05), min(1.0, rate + 0.05)),
            "base_count": base_count, "base_n": 200, "base_rate": base_count / 200, "p_value": 0.01,
            "q_value": 0.02}  # fmt: skip


def _row(i: int, model: str, class_name: str, description: str, target: str = "goldfish") -> dict:
    return {
        "model": model, "class_name": class_name, "description": description, "target_name": target,
        "discovered_by": ["total"] if i % 2 == 0 else [],
        "tests": {"target_label": _test(0.05 * (i % 10)), "total": _test(0.1 * (i % 10))},
    }  # fmt: skip


def _texts_outside(fig) -> list[str]:
    """Every non-empty visible text whose rendered box leaves the figure (half a pixel of slack for rounding)."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    outside = []
    for text in fig.findobj(Text):
        if not text.get_visible() or not text.get_text().strip():
            continue
        extent = text.get_window_extent(renderer)
        if extent.x0 < box.x0 - 0.5 or extent.y0 < box.y0 - 0.5 or extent.x1 > box.x1 + 0.5 or extent.y1 > box.y1 + 0.5:
            outside.append(f"{text.get_text()!r}: {extent} not in {box}")
    return outside


@pytest.mark.parametrize("n_rows", [1, 12])
def test_no_plot_label_is_clipped_however_long_the_names(n_rows):
    import matplotlib.pyplot as plt

    rows = [
        _row(i, "vit_large_patch14_clip_336.openai_ft_in12k_in1k", "American Staffordshire terrier " * 3,
             "snowy mountain pasture at dusk with fog " * 2, "Greater Swiss Mountain dog " * 3)
        for i in range(n_rows)
    ]  # fmt: skip
    rows.append(_row(n_rows, "r", "t", "x", "y"))  # short labels beside long ones
    fig = rates_figure(rows)
    try:
        assert _texts_outside(fig) == []
        labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
        assert len(labels) == len(rows) and all(labels)
        assert [ax.get_title() for ax in fig.axes] == ["rate of the target label", "total failure rate"]
    finally:
        plt.close(fig)


def test_the_saved_plot_is_the_figure_that_was_checked(tmp_path):
    """savefig writes the figure at its own size (no bbox cropping that could hide or add anything)."""
    import matplotlib.pyplot as plt
    from PIL import Image

    rows = [_row(i, "resnet50.a1_in1k", "goldfish", "red water plants") for i in range(3)]
    fig = rates_figure(rows)
    width, height = fig.get_size_inches()
    fig.savefig(tmp_path / "rates.png", dpi=100)
    plt.close(fig)
    assert Image.open(tmp_path / "rates.png").size == (round(width * 100), round(height * 100))


def test_report_escapes_every_text_from_models_and_captions(tmp_path):
    from PIL import Image

    hostile = "<script>alert(1)</script>&"
    hypothesis = {
        "description": hostile, "clusters": [0], "members": ["b0"], "target_label": 1, "prompt": hostile,
        "keys": ["d0"], "confusions": {"1": 4}, "discovered": True, "discovered_by": ["target_label", "total"],
        "refined_description": hostile,
        "tests": {"target_label": {**_test(1.0), "label": 1}, "total": _test(1.0)},
        "refinement": [{"description": hostile, "significant": True,
                        "tests": {"target_label": _test(0.9), "total": _test(0.9)}}],
    }  # fmt: skip
    document = {
        "generator": {"model": hostile, "stand_in": True}, "captioner": {"model": "cap"},
        "settings": {"n_base": 4, "n_test": 4, "alpha": 0.05},
        "models": {hostile: {
            "families": {"descriptions": {"tests": 2, "bh_cutoff_p": 0.01}, "refinements": {"tests": 2,
                                                                                           "bh_cutoff_p": 0.01}},
            "classes": [{"label": 0, "class_name": hostile, "base": {"interval": (0.0, 0.5)},
                         "clusters": [{"description": hostile, "members": ["b0"]}], "hypotheses": [hypothesis]}],
        }},
    }  # fmt: skip
    page = write_discovery_report(
        document, lambda keys: [Image.new("RGB", (8, 8)) for _ in keys], lambda model, keys: dict.fromkeys(keys, 1),
        lambda label: hostile, tmp_path,
    ).read_text()  # fmt: skip
    assert "<script>" not in page and page.count("&lt;script&gt;alert(1)&lt;/script&gt;&amp;") >= 8
    assert (tmp_path / "assets" / "rates.png").is_file()
