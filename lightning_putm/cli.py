"""Shared entry-point wrapper: one clear message and a non-zero exit for user errors."""

from __future__ import annotations

import sys
from typing import Callable, Sequence

from lightning_putm.errors import LightningPutmError

EXIT_USER_ERROR = 2


def run_cli(main: Callable[[Sequence[str]], object], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)``; print user errors as one line (full traceback with ``debug=true``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = any(a.replace(" ", "") in ("debug=true", "debug=True", "debug=1") for a in args)
    if any(a in ("-h", "--help", "help") for a in args):
        print((main.__doc__ or "").strip())
        return 0
    try:
        main(args)
    except LightningPutmError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
