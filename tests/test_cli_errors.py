"""No raw traceback from ``lance-cf``: an exception no command expected is one line naming it and the file that holds
its traceback (exit 1), and every number option of every command is bounded by the parser itself."""

from __future__ import annotations

import argparse

import pytest

from builder.cli import build_parser, main
from builder.cli_types import MAX_INT_DIGITS, bounded_int, finite_float


def _numeric_options(parser: argparse.ArgumentParser, prefix: str = "lance-cf"):
    """(command, option, type) of every option that takes a value, in every subcommand at any depth."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _numeric_options(sub, f"{prefix} {name}")
        elif action.option_strings and action.nargs != 0:
            yield prefix, action.option_strings[-1], action.type


def test_every_number_option_of_every_command_is_bounded_by_the_parser():
    options = list(_numeric_options(build_parser()))
    assert len(options) > 100  # the whole tree was walked
    bare = [f"{c} {o}" for c, o, t in options if t in (int, float)]
    assert not bare, f"options parsed by bare int/float (unbounded): {bare}"
    ints = [(c, o) for c, o, t in options if t is bounded_int]
    floats = [(c, o) for c, o, t in options if t is finite_float]
    assert len(ints) > 30 and len(floats) > 10, (len(ints), len(floats))
    with pytest.raises(argparse.ArgumentTypeError, match=f"at most {MAX_INT_DIGITS} digits"):
        bounded_int("9" * 5000)
    for text in ("nan", "inf", "-inf", "1e999"):
        with pytest.raises(argparse.ArgumentTypeError, match="finite"):
            finite_float(text)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["eval", "--release", "r", "--model", "m", "--output", "o", "--batch-size", "9" * 400], "--batch-size"),
        (["discover", "--alpha", "nan"], "--alpha: expected a finite number"),
        (["build", "demo", "--output", "o", "--seed", "1" * 40], "--seed: expected an integer of at most 18"),
    ],
)
def test_a_number_option_out_of_range_is_argparse_s_one_line(capsys, args, said):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err[:300]


def test_an_unexpected_error_is_one_line_and_a_traceback_file(tmp_path, monkeypatch, lance_cf):
    """A bug planted in a command (its run function raises KeyError): one line, exit 1, the traceback in the file
    the line names, under $LANCE_CF_TRACEBACK_DIR (else the user's cache). The command runs in this process: both
    variables are read when the error is reported, not at start-up."""
    import builder.cli_class_map

    def broken(args):
        err = KeyError("planted")
        err.add_note("raised by stage caption on sample k1")
        raise err

    monkeypatch.setattr(builder.cli_class_map, "run_class_map", broken)
    monkeypatch.chdir(tmp_path)  # the command's lock folder (.lance-cf/) goes where a user would run it, not the repo
    folder = tmp_path / "tracebacks"
    monkeypatch.setenv("LANCE_CF_TRACEBACK_DIR", str(folder))
    code, _, err = lance_cf("class-map", "somewhere")
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(
        "lance-cf class-map: error: unexpected KeyError ('planted' raised by stage caption on"
    ), lines[0]
    written = list(folder.iterdir())
    assert len(written) == 1 and str(written[0]) in lines[0]
    text = written[0].read_text()
    assert "Traceback (most recent call last)" in text and "KeyError: 'planted'" in text and "def broken" not in text
    assert "raise err" in text  # the planted function's frame, from this file
    # without the variable: the user's cache
    monkeypatch.delenv("LANCE_CF_TRACEBACK_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code, _, err = lance_cf("class-map", "somewhere")
    assert code == 1 and str(tmp_path / "cache" / "lance-cf" / "tracebacks") in err
