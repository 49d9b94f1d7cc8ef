"""Model-free stages for builder tests: deterministic, optionally slow, optionally failing on chosen samples."""

from __future__ import annotations

import time

import numpy as np
from PIL import Image, ImageOps

from lance_pipeline.models.needs import ModelOption
from lance_pipeline.stage import ReleaseOutput, SampleFailure


class FakeCaptionStage:
    name = "caption"
    version = "1"
    consumes = {"label_name": "str", "seed": "int"}
    produces = {"caption": "str"}

    def __init__(self, delay: float = 0.0, fail_keys: list[str] | None = None, hold: str | None = None):
        self.delay = delay
        self.fail_keys = set(fail_keys or [])
        self.hold = hold
        self.calls = 0

    def load(self, device: str) -> None:
        self.device = device

    def process(self, records):
        time.sleep(self.delay)
        self._wait_at_hold()
        out = []
        for r in records:
            if r["key"] in self.fail_keys:
                raise RuntimeError(f"cannot caption {r['key']}")  # the engine must isolate this sample
            out.append({"caption": f"a photo of a {r['label_name']} (seed {r['seed']})"})
        return out

    def _wait_at_hold(self) -> None:
        """With ``hold`` (a named pipe the test made), the build stops in its first batch until the test, which opens
        the pipe for writing to know the build got here, removes the pipe and closes its end: a barrier, no delay."""
        if self.hold is None:
            return
        hold, self.hold = self.hold, None
        try:
            with open(hold, encoding="utf-8") as pipe:
                pipe.read()
        except FileNotFoundError:
            pass  # the test already let the build go

    def describe(self):
        return {"model": "fake-captioner", "revision": "0" * 40}


class FakeEditStage:
    """Returns a reconstruction (the image inverted) and two counterfactuals with scores of varied JSON types."""

    name = "edit"
    version = "1"
    consumes = {"caption": "str"}
    produces = {"reconstruction": "image", "counterfactuals": "list", "lance_r": "list"}
    outputs = (
        ReleaseOutput("reconstructed", "reconstruction", "rec"),
        ReleaseOutput("counterfactual", "counterfactuals", "cf", many=True),
        ReleaseOutput("lance_r", "lance_r", "lr", many=True),
    )

    def __init__(self, delay: float = 0.0, refuse_keys: list[str] | None = None):
        self.delay = delay
        self.refuse_keys = set(refuse_keys or [])

    def load(self, device: str) -> None:
        pass

    def process(self, records):
        time.sleep(self.delay)
        out = []
        for i, r in enumerate(records):
            if r["key"] in self.refuse_keys:
                out.append(SampleFailure("no edit passed the gates"))
                continue
            rng = np.random.default_rng(r["seed"])
            noise = rng.integers(0, 255, size=(*r["image"].size[::-1], 3), dtype=np.uint8)
            first = i == 0
            out.append(
                {
                    "reconstruction": ImageOps.invert(r["image"]),
                    "counterfactuals": [
                        {
                            "image": Image.fromarray(noise),
                            "edit_type": "background",
                            "edited_caption": r["caption"] + " in the snow",
                            "original_span": "",
                            "edited_span": "in the snow",
                            "self_replace": 1 if first else 0.6,  # an integral value must still load as float
                            "scores": {"label_similarity": 0 if first else 0.25, "clip_image": None},
                        },
                        {
                            "image": r["image"].rotate(90),
                            "edit_type": "weather",
                            "edited_caption": r["caption"] + " on a rainy day",
                            "original_span": "",
                            "edited_span": "on a rainy day",
                            "self_replace": 0.8,
                            "scores": {"clip_directional": None if first else 0.31},
                        },
                    ],
                    "lance_r": [
                        {
                            "image": r["image"].transpose(Image.Transpose.FLIP_LEFT_RIGHT),
                            "edit_type": None,
                            "edited_caption": r["caption"].replace("photo", "picture"),
                            "original_span": "photo",
                            "edited_span": "picture",
                            "self_replace": None,
                            "scores": {},
                        }
                    ],
                }
            )
        return out

    def describe(self):
        return {"model": "fake-editor"}


class MirrorStage:
    """Writes a release config of its own ("mirrored"), which the core does not know: outputs are declared."""

    name = "mirror"
    version = "1"
    consumes = {"caption": "str"}
    produces = {"mirrored": "image"}
    outputs = (ReleaseOutput("mirrored", "mirrored", "mir", description="the source images, mirrored"),)

    def load(self, device: str) -> None:
        pass

    def process(self, records):
        return [{"mirrored": ImageOps.mirror(r["image"])} for r in records]

    def describe(self):
        return {}


class ReadsUndeclaredField(MirrorStage):
    """Reads ``caption`` without declaring it: a programming error the engine must stop on, not data."""

    consumes = {}

    def process(self, records):
        return [SampleFailure("no caption") if r.get("caption") is None else {} for r in records]


class WritesUndeclaredField(FakeCaptionStage):
    """Returns a misspelt field: the engine must stop on it at the first batch."""

    def process(self, records):
        return [{"captoin": "a photo"} for _ in records]


class FlakyCaptionStage(FakeCaptionStage):
    """Raises (like a CUDA out-of-memory) on the samples named by files in ``trouble_dir``: remove a file, the cause
    is gone. With ``refuse=True`` it returns a final ``SampleFailure`` for them instead. With ``bug=True`` it raises
    a KeyError (a programming error)."""

    def __init__(self, trouble_dir: str, refuse: bool = False, bug: bool = False, log_calls: str | None = None):
        super().__init__()
        self.trouble_dir = trouble_dir
        self.refuse = refuse
        self.bug = bug
        self.log_calls = log_calls

    def process(self, records):
        import os

        import torch

        out = []
        for r in records:
            if self.log_calls:
                with open(self.log_calls, "a") as f:
                    f.write(f"{r['key']} threads={torch.get_num_threads()}\n")
            if os.path.exists(os.path.join(self.trouble_dir, r["key"])):
                if self.bug:
                    raise KeyError("edited_caption")
                if self.refuse:
                    out.append(SampleFailure("the caption model refused this image"))
                    continue
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
            out.append({"caption": f"a photo of a {r['label_name']} (seed {r['seed']})"})
        return out


class FakeAllocatingStage:
    """Holds ``mebibytes`` of written memory while it processes a batch (``big_key`` in the batch: ``big_mebibytes``)."""

    name = "alloc"
    version = "1"
    consumes = {"caption": "str"}
    produces = {}

    def __init__(self, mebibytes: int = 8, big_mebibytes: int = 64, big_key: str = ""):
        self.mebibytes = mebibytes
        self.big_mebibytes = big_mebibytes
        self.big_key = big_key

    def load(self, device: str) -> None:
        pass

    def process(self, records):
        size = self.big_mebibytes if any(r["key"] == self.big_key for r in records) else self.mebibytes
        held = np.ones(size * 2**20, dtype=np.uint8)  # written, so resident
        assert int(held[::4096].sum()) == size * 2**20 // 4096
        return [{} for _ in records]

    def describe(self):
        return {"model": None}


class HubModelCaptionStage(FakeCaptionStage):
    """A caption stage that declares a Hub model (``model`` at ``revision``) and loads nothing: what a build checks
    before its stages load, without a model."""

    model_options = (
        ModelOption("model", role="test captioner"),
        ModelOption("helper", revision="helper_revision", role="test helper"),
    )

    def __init__(
        self,
        model: str = "org/tiny-captioner",
        revision: str | None = None,
        helper: str | None = None,
        helper_revision: str | None = None,
    ):
        super().__init__()
        self.model, self.revision, self.helper, self.helper_revision = model, revision, helper, helper_revision


class GatedCaptionStage(FakeCaptionStage):
    """Waits at a barrier before captioning the samples named in ``hold_keys`` (no clock involved): in this process,
    until ``GATE`` is set; with ``fifo`` (a named pipe), it writes a line to it (blocking until a reader opens it: the
    test knows the stage runs) and then waits on ``GATE`` (a test stops the process meanwhile)."""

    GATE = None  # a threading.Event, set by the test

    def __init__(self, hold_keys: list[str] | None = None, fifo: str | None = None):
        super().__init__()
        self.hold_keys = set(hold_keys or [])
        self.fifo = fifo

    def process(self, records):
        import threading

        if any(r["key"] in self.hold_keys for r in records):
            if GatedCaptionStage.GATE is None:
                GatedCaptionStage.GATE = threading.Event()
            if self.fifo:
                with open(self.fifo, "w") as pipe:
                    pipe.write("running\n")
            GatedCaptionStage.GATE.wait()
        return super().process(records)
