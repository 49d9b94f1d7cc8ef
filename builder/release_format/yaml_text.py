"""The one YAML reader for everything the tool reads as YAML (build configs, presets, cards' front matter), and the
one writer of cards' front matter (``dump_yaml``).

``yaml.safe_load`` runs no code, but an alias makes two places share one value, so a 1 KB document can stand for
billions of values (the "billion laughs" bomb): nothing is expanded while loading, but everything that later walks
the value (the config hash, JSON, a copy) expands it and hangs. ``load_yaml`` measures the value's expanded size
once, in linear time over the distinct values, and refuses a document that would expand past ``MAX_YAML_VALUES``, that
refers to itself, or that nests too deeply to walk. ``expanded_size`` is the same measure for a value built in Python
(a config given to ``build()`` directly). Lives in the release format because it is the lowest layer: cards are read
there too.
"""

from __future__ import annotations

from typing import Any

# Far above any real config or card (the largest preset is a few hundred values), far below a hang.
MAX_YAML_VALUES = 1_000_000

__all__ = ["MAX_YAML_VALUES", "dump_yaml", "expanded_size", "load_yaml"]


def load_yaml(text: str, origin: str) -> Any:
    """``yaml.safe_load(text)`` (with libyaml where available), refusing with a one-line ``ValueError`` naming
    ``origin``: invalid YAML, or a document whose aliases expand past ``MAX_YAML_VALUES`` values (or that refers to
    itself, or nests too deeply)."""
    import yaml

    # libyaml's parser when PyYAML has it (the same values, about ten times faster: a card's front matter lists every
    # class name once per config, 180 KB for ImageNet's 1,000 in the demo); the pure-Python one otherwise.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        data = yaml.load(text, Loader=loader)
    except yaml.YAMLError as err:
        raise ValueError(f"{origin}: not valid YAML ({' '.join(str(err).split())})") from err
    except RecursionError:
        raise ValueError(f"{origin}: the YAML nests too deeply to read") from None
    check_expansion(data, origin)
    return data


def dump_yaml(value: Any) -> str:
    """``value`` as block YAML the way the Hub's card classes write front matter (keys in their order, Unicode kept,
    no trailing newline), with libyaml's emitter where PyYAML has it: the same text, about five times faster than the
    pure-Python emitter on an ImageNet card (0.06 s instead of 0.33 s)."""
    import yaml

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return yaml.dump(value, Dumper=dumper, sort_keys=False, allow_unicode=True).strip()


def check_expansion(value: Any, origin: str) -> None:
    """Raise the one-line ``ValueError`` of ``load_yaml`` if ``value`` expands past ``MAX_YAML_VALUES`` values."""
    size = expanded_size(value, MAX_YAML_VALUES)
    if size > MAX_YAML_VALUES:
        raise ValueError(
            f"{origin}: its aliases (*name) expand to more than {MAX_YAML_VALUES:,} values (a YAML alias bomb?); "
            "write the values out, or use fewer aliases"
        )


def expanded_size(value: Any, limit: int = MAX_YAML_VALUES) -> int:
    """How many values ``value`` holds with every shared list or mapping counted each time it appears; stops early
    past ``limit`` (returns ``limit + 1``). A value that contains itself counts as unbounded."""
    memo: dict[int, int] = {}
    open_ids: set[int] = set()

    def size(item: Any, depth: int) -> int:
        if not isinstance(item, dict | list | tuple | set):
            return 1
        key = id(item)
        if key in memo:
            return memo[key]
        if key in open_ids or depth > 200:  # refers to itself, or nests deeper than any config
            return limit + 1
        open_ids.add(key)
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else list(item)
        total = 1
        for child in children:
            total += size(child, depth + 1)
            if total > limit:
                break
        open_ids.discard(key)
        memo[key] = min(total, limit + 1)
        return memo[key]

    return size(value, 0)
