"""The commands' option defaults are the config's (one place for each), and `build_config` takes
exactly the `encode` command's parameters, typed."""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields
from typing import Any

import click
import typer

from mmenc_cli.cli import app
from mmenc_cli.cli.encode import EncodeOptions, encode
from mmenc_cli.config import DEFAULT_DECODE, DEFAULT_FRAMES, MAX_FPS_FRAMES, config_fields
from mmenc_cli.slurm import SlurmOptions

#: encode options that are not a config field: the CLI resolves or uses them itself
ENCODE_CLI_ONLY = {"manifests", "out", "model", "modality", "task_index", "task_count", "progress", "log_every",
                   "json_out", "verbose"}
#: slurm options and the `SlurmOptions` field each fills
SLURM_FIELDS = {"partition": "partition", "time_limit": "time", "gpus_per_task": "gpus_per_task",
                "cpus_per_task": "cpus_per_task", "mem": "mem", "signal_before": "signal_before",
                "requeue": "requeue"}


def command(name: str) -> click.Command:
    return typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]


def cli_default(param: click.Parameter) -> Any:
    """The default as the config spells it: a repeatable option's "not given" is an empty tuple."""
    return tuple(param.default or ()) if getattr(param, "multiple", False) else param.default


def test_encode_option_defaults_are_the_configs() -> None:
    config = {path[-1]: f for path, f in config_fields()}
    params = {p.name: p for p in command("encode").params}
    assert ENCODE_CLI_ONLY <= set(params)
    unmatched = set(params) - ENCODE_CLI_ONLY - set(config)
    assert unmatched == set(), "each encode option is a config field, or CLI-only"
    checked = 0
    for name in set(params) - ENCODE_CLI_ONLY:
        f = config[name]
        assert f.default is not MISSING or f.default_factory is not MISSING, name
        want = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        assert cli_default(params[name]) == want, f"--{name.replace('_', '-')}"
        checked += 1
    assert checked >= 40


def test_slurm_option_defaults_are_slurm_options() -> None:
    params = {p.name: p for p in command("slurm").params}
    defaults = {f.name: f.default for f in fields(SlurmOptions)}
    for name, field_name in SLURM_FIELDS.items():
        assert params[name].default == defaults[field_name], name


def test_help_shows_the_configs_defaults() -> None:
    params = {p.name: p for p in command("encode").params}
    assert f"[default: {DEFAULT_FRAMES}; with --fps {MAX_FPS_FRAMES}]" in params["frames"].help
    assert f"[default: {DEFAULT_DECODE};" in params["decode"].help


def test_encode_options_are_the_commands_parameters() -> None:
    """A renamed or added option must be renamed or added in `EncodeOptions` too, in the same place."""
    assert [f.name for f in fields(EncodeOptions)] == list(inspect.signature(encode).parameters)
    assert all(f.default is MISSING for f in fields(EncodeOptions))  # the defaults are the command's, from config
