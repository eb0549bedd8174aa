"""argparse types for numbers of seconds, shared by the verbs of every CLI module: nan, inf and
out-of-range values are usage errors (exit 64), not values that silently mean 'forever' or 'never'."""
from __future__ import annotations

import argparse
import math


def seconds(text: str) -> float:
    """A finite number >= 0 (seconds, or a fraction): `wait --timeout`."""
    value = _number(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def period(text: str) -> float:
    """A finite number > 0: how often something repeats (`top --interval`)."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
