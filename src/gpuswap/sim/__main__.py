"""`python -m gpuswap.sim ...`: the `gpuswap sim` command without the main CLI."""
import argparse
import sys

from gpuswap.sim.cli import add_arguments, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="gpuswap sim", description="trace-driven scheduling simulator")
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
