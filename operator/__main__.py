"""`python -m metronome.operator` = `metronome operator` (same flags), without the other sub-commands' imports."""
import argparse
import sys

from metronome.operator.main import configure, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metronome.operator", description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
