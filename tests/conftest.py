"""Test-wide settings: everything offline, caches inside the test session's temporary directory."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Tiny demo components are built into a per-session cache, not the user's ~/.cache/lance-cf.
if "LANCE_CF_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="lance-cf-test-cache-")
    os.environ["LANCE_CF_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
