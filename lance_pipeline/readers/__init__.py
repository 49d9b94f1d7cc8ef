"""The one reader of structured input (YAML, JSON, JSON lines), bounded and strict: ``structured``.

The lowest room of the project: it imports no other, so the release format, the method's rooms, the builder,
evaluation and the cards all read user input through it (docs/architecture.md, docs/reliability.md).
"""

from lance_pipeline.readers.structured import (
    MAX_DEPTH,
    MAX_INPUT_BYTES,
    MAX_INT_DIGITS,
    MAX_VALUES,
    InputError,
    check_expansion,
    expanded_size,
    expect_bool,
    expect_int,
    expect_list,
    expect_mapping,
    expect_number,
    expect_str,
    load_json,
    load_json_lines,
    load_yaml,
    read_json,
    read_json_lines,
    read_text,
    read_yaml,
)

__all__ = [
    "MAX_DEPTH",
    "MAX_INPUT_BYTES",
    "MAX_INT_DIGITS",
    "MAX_VALUES",
    "InputError",
    "check_expansion",
    "expanded_size",
    "expect_bool",
    "expect_int",
    "expect_list",
    "expect_mapping",
    "expect_number",
    "expect_str",
    "load_json",
    "load_json_lines",
    "load_yaml",
    "read_json",
    "read_json_lines",
    "read_text",
    "read_yaml",
]
