"""Determined verbs this platform has no counterpart for: each prints one line saying so and
what to use instead, and exits non-zero. Nothing is accepted and silently ignored."""

from __future__ import annotations

import argparse
from typing import Any

from det_tasks.errors import DetTasksError

__all__ = ["EXIT_UNSUPPORTED", "Unsupported", "add_unsupported", "refuse_flag"]

EXIT_UNSUPPORTED = 2


class Unsupported(DetTasksError):
    """A Determined verb or flag ``det`` does not provide here."""


def add_unsupported(
    sub: Any, path: str, name: str, instead: str, aliases: tuple[str, ...] = ()
) -> None:
    """A subcommand ``det PATH NAME`` that takes anything and says it is not supported here,
    and what to use instead."""
    parser = sub.add_parser(name, aliases=list(aliases), add_help=False)
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    refused = f"{path} {name}".strip()
    parser.set_defaults(func=_refuse, refused=refused, instead=instead, platform=False)


def _refuse(args: argparse.Namespace) -> int:
    raise Unsupported(f"`det {args.refused}` is not supported here: {args.instead}")


def refuse_flag(parser: argparse.ArgumentParser, flags: list[str], instead: str) -> None:
    """A Determined flag that would change what happens but cannot be honoured here."""
    parser.add_argument(
        *flags, action=_RefuseFlag, nargs=0, help=argparse.SUPPRESS, instead=instead
    )


class _RefuseFlag(argparse.Action):
    def __init__(self, *args: Any, instead: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.instead = instead

    def __call__(self, parser: Any, namespace: Any, values: Any, option: str | None = None) -> None:
        raise Unsupported(f"`{option}` is not supported here: {self.instead}")
