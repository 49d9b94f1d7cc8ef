"""Models loaded once per process and shared by the stages that ask for the same one.

Several stages of a build load the same model: the label check and the three sensitive-edit screens of the demo all
use all-MiniLM-L6-v2, the four safety-check stages one safety checker. ``shared_model`` gives every stage that asks
with the same key (model, revision, device, dtype) the same loaded object. The map holds its values weakly (as
``lance_pipeline.editing.sd_components`` does for Stable Diffusion): it keeps nothing alive, so a model is freed once
the last stage holding it is released, and the stage-major schedule still frees each stage's memory before the next
one loads. A shared model is only read (inference, never trained or moved), so sharing cannot change a result.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_SHARED: weakref.WeakValueDictionary[tuple, object] = weakref.WeakValueDictionary()
# Re-entrant: a loader may itself ask for a shared model. Held while loading, so two threads asking for the same
# model load it once.
_LOCK = threading.RLock()


def shared_model(key: tuple, load: Callable[[], T]) -> T:
    """The live object loaded for ``key``, or ``load()`` (kept weakly under ``key`` for the next caller).

    Args:
        key: What makes two loads the same, e.g. ``("sentence-transformers", path or id, revision, device, dtype)``;
            a local directory should be given as an absolute path.
        load: Loads the model; its result must accept weak references (``torch.nn.Module`` and plain objects do).
    """
    with _LOCK:
        model = _SHARED.get(key)
        if model is None:
            model = load()
            _SHARED[key] = model
        return model  # type: ignore[return-value]
