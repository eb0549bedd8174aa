"""`python -m gpuswap.sim ...`: the `gpuswap sim` command without the main CLI."""
import argparse
import sys

from gpuswap.exitcodes import EX_USAGE
from gpuswap.sim.cli import add_arguments, run


class _Parser(argparse.ArgumentParser):
    """Usage errors exit EX_USAGE (64) with one line, as `gpuswap sim` does (argparse's own exit is 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: {message}", file=sys.stderr)
        sys.exit(EX_USAGE)


def main() -> int:
    parser = _Parser(prog="gpuswap sim", description="trace-driven scheduling simulator")
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
