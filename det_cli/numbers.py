"""Numbers typed on the ``det`` command line: finite and positive where a duration or a size
is meant (``float("nan")`` and ``float("inf")`` parse, and would mean "never" or "always")."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["positive_number"]


def positive_number(name: str) -> Callable[[str], float]:
    """An argparse ``type`` for option ``name``: a finite number above 0, else one line."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} {text!r} is not a number") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(
                f"{name} {text!r} must be a finite number above 0, e.g. 5"
            )
        return value

    return parse
