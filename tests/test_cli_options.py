"""The shared options: declared once as dataclasses, expanded into each command by with_options, and handed
to the command whole."""

# no `from __future__ import annotations`: the test commands annotate with local names, which typer
# must see as objects

from typing import Annotated, Any

import pytest
import typer

from s4r_cli.cli_errors import UsageError
from s4r_cli.options import CommonArgs, Dtype, Ingest, ModelOptions, common_args, with_options


def _run(command: Any, args: list[str]) -> Any:
    """Register `command` (through with_options) in a fresh app, run it on `args`, return what it got."""
    seen: list[Any] = []
    app = typer.Typer()

    @app.command()
    @with_options
    def cmd(ctx: typer.Context, opts: command,  # type: ignore[valid-type]
            count: Annotated[int, typer.Option("--count")] = 0) -> None:
        seen.append((ctx, opts, count))

    @app.command()
    def other() -> None:  # a second command, so typer keeps `cmd` as a subcommand
        pass

    typer.main.get_command(app).main(["cmd", *args], standalone_mode=False)
    return seen[0]


def test_model_options_arrive_as_one_object() -> None:
    _, opts, count = _run(ModelOptions, ["--model", "org/name", "--threads", "3", "--dtype", "fp16",
                                         "--count", "7"])
    assert opts == ModelOptions(model="org/name", device="auto", dtype=Dtype.fp16, threads=3)
    assert count == 7  # the command's own options still reach it


def test_defaults_come_from_the_dataclass() -> None:
    _, opts, _ = _run(ModelOptions, [])
    assert opts == ModelOptions()


def test_common_args_build_generation_and_note_typed_session_options() -> None:
    ctx, args, _ = _run(CommonArgs, ["-f", "a.txt", "-f", "b.txt", "--ratio", "8", "--ingest", "chunked",
                                     "-t", "0.7", "--seed", "3"])
    args = common_args(ctx, args)
    assert args.files == ["a.txt", "b.txt"] and args.books == []
    assert args.ratio == 8.0 and args.ingest is Ingest.chunked
    assert (args.generation.temperature, args.generation.seed) == (0.7, 3)
    # a saved cache keeps its own settings for what was not typed
    assert args.explicit == {"ratio", "ingest"}
    assert args.session_kwargs(only_explicit=True) == {"ratio": 8.0, "ingest": "chunked"}


def test_hidden_spill_is_a_session_option() -> None:
    ctx, args, _ = _run(CommonArgs, ["--hidden-spill", "off"])
    args = common_args(ctx, args)
    assert args.explicit == {"hidden_spill"}
    assert args.session_kwargs(only_explicit=True) == {"hidden_spill": "off"}
    _, default, _ = _run(CommonArgs, [])
    assert default.session_kwargs()["hidden_spill"] == "auto"


def test_common_args_are_validated() -> None:
    ctx, args, _ = _run(CommonArgs, ["--ratio", "0.5"])
    with pytest.raises(UsageError, match="--ratio must be at least 1"):
        common_args(ctx, args)


def test_help_lists_the_expanded_options() -> None:
    app = typer.Typer()

    @app.command()
    @with_options
    def cmd(opts: ModelOptions) -> None:
        pass

    @app.command()
    def other() -> None:
        pass

    command = typer.main.get_command(app).commands["cmd"]  # type: ignore[attr-defined]
    names = {p.name for p in command.params}
    assert {"model", "device", "dtype", "threads"} <= names and "opts" not in names
