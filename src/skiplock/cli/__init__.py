"""The ``skiplock`` command line; ``skiplock.cli.common`` holds what every command shares."""

from ._main import main

__all__ = ["main"]
