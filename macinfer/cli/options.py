"""Options every `macinfer` command shares: logging."""

from __future__ import annotations

import logging

import click

LOG_LEVELS = ("debug", "info", "warning", "error")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s", force=True)


def log_options(f):
    """-v / --log-level on every command too, so they work after the subcommand."""
    def set_level(ctx, _param, value):
        if value:
            setup_logging("info" if value is True else value)
        return value

    f = click.option("-v", "--verbose", is_flag=True, expose_value=False, callback=set_level,
                     help="Log engine details and, for serve, every request.")(f)
    f = click.option("--log-level", type=click.Choice(LOG_LEVELS), default=None, expose_value=False,
                     callback=set_level, help="Logging level.")(f)
    return f
