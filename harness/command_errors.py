"""Bad input at batchlab's commands: one line on stderr, exit status 2, the traceback behind ``--verbose``
(every entry point shares it, so it sits below them all).

    parser = OneLineParser(prog="batchlab-x", ...)      # a bad flag: "batchlab-x: error: ...; see --help"
    add_verbose(parser)
    return one_line_errors("batchlab-x", lambda: body(args), verbose=args.verbose)

``HYDRA_FULL_ERROR=1`` (the variable Hydra users already know) shows the traceback too.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

#: exit status of a command given input it cannot use (as argparse's own)
EXIT_BAD_INPUT = 2
#: what the commands raise for input they cannot use: a setting out of range, a file that is not there or not
#: readable as what it should be (every message names the input, the value and the fix)
BAD_INPUT = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}; see {self.prog} --help", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)


def add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true", help="on an error, also print its full traceback")


def full_errors(verbose: bool = False) -> bool:
    """Whether to print tracebacks: ``--verbose`` or ``HYDRA_FULL_ERROR=1``."""
    return verbose or os.environ.get("HYDRA_FULL_ERROR") == "1"


def one_line_errors(prog: str, body: Callable[[], int], verbose: bool = False) -> int:
    """``body()``'s exit status; bad input (:data:`BAD_INPUT`) is one line on stderr and status 2."""
    try:
        return body()
    except BAD_INPUT as error:
        if full_errors(verbose):
            traceback.print_exc()
        hint = "" if full_errors(verbose) else " (--verbose for the traceback)"
        print(f"{prog}: error: {describe(error)}{hint}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT


def describe(error: BaseException) -> str:
    """The error's message on one line; an OS error as ``PATH: what``."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror.lower()}"
    text = " ".join(str(error).split())
    return text or type(error).__name__


def at_least(cast: Callable[[str], float], minimum: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: ``cast(text)``, refused unless ``>= minimum`` (``> minimum`` with ``above``)."""
    def parse(text: str) -> float:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if cast is int else ' number'}") from None
        if value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(f"{text} is too small: give a number {'>' if above else '>='} {minimum}")
        return value
    return parse
