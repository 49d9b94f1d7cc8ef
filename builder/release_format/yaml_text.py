"""The writer of cards' front matter (``dump_yaml``), and the YAML reader under the names its users know.

Reading is ``lance_pipeline.readers`` (the one reader of YAML, JSON and JSON lines, bounded and strict; see its
docstring): ``load_yaml``, ``check_expansion``, ``expanded_size`` and ``MAX_YAML_VALUES`` here are that reader's.
"""

from __future__ import annotations

from typing import Any

from lance_pipeline.readers.structured import MAX_VALUES as MAX_YAML_VALUES
from lance_pipeline.readers.structured import check_expansion, expanded_size, load_yaml

__all__ = ["MAX_YAML_VALUES", "check_expansion", "dump_yaml", "expanded_size", "load_yaml"]


def dump_yaml(value: Any) -> str:
    """``value`` as block YAML the way the Hub's card classes write front matter (keys in their order, Unicode kept,
    no trailing newline), with libyaml's emitter where PyYAML has it: the same text, about five times faster than the
    pure-Python emitter on an ImageNet card (0.06 s instead of 0.33 s)."""
    import yaml

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return yaml.dump(value, Dumper=dumper, sort_keys=False, allow_unicode=True).strip()
