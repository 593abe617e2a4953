"""The command line: argument parsing (main.py), mount supervision, the log
format, and each command's presentation (stage progress, stats, top, the
demo). Nothing outside this package imports argparse or rich."""

from cachefsd.cli.main import main

__all__ = ["main"]
