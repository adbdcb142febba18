"""Shared entry-point wrapper: one clear message and a non-zero exit for user errors."""

from __future__ import annotations

import sys
from typing import Callable, Sequence

from lightning_putm.errors import LightningPutmError

EXIT_USER_ERROR = 2


def user_message(exc: BaseException) -> str:
    """The error's message on one line.

    An error raised inside a DataLoader worker (``data.num_workers > 0``) comes back re-raised with the worker's
    whole traceback as its message; only the original message (its last line) is meant for the user.
    """
    text = str(exc)
    if "Original Traceback (most recent call last)" in text:
        last = [line for line in text.strip().splitlines() if line.strip()][-1].strip()
        name = type(exc).__name__
        for prefix in (f"{type(exc).__module__}.{name}: ", f"{name}: "):
            if last.startswith(prefix):
                last = last[len(prefix):]
        text = last
    return " ".join(text.split()) if "\n" in text else text


def normalise_arguments(args: list[str]) -> list[str]:
    """``--config PATH`` and ``--config=PATH`` mean ``config=PATH`` (the form most tools use)."""
    out: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--config" and index + 1 < len(args):
            out.append(f"config={args[index + 1]}")
            index += 2
            continue
        out.append(f"config={arg.split('=', 1)[1]}" if arg.startswith("--config=") else arg)
        index += 1
    return out


def run_cli(main: Callable[[Sequence[str]], object], argv: Sequence[str] | None = None, job: str | None = None,
            help_text: Callable[[str], str] | None = None) -> int:
    """Run ``main(argv)``; print user errors as one line (full traceback with ``debug=true``).

    ``-h``/``--help`` prints every key of the ``job``'s config with type, default and meaning (``help_text``, given
    ``main``'s docstring, writes it for a job whose help is built differently, such as ``evaluate.py predict``).
    """
    args = normalise_arguments(list(sys.argv[1:] if argv is None else argv))
    debug = any(a.replace(" ", "") in ("debug=true", "debug=True", "debug=1") for a in args)
    if any(a in ("-h", "--help", "help") for a in args):
        if help_text is not None:
            print(help_text(main.__doc__ or ""))
        elif job is None:
            print((main.__doc__ or "").strip())
        else:
            from lightning_putm.help import job_help  # only for --help: reads every config file

            try:
                print(job_help(job, main.__doc__ or "", args))
            except LightningPutmError as exc:  # a plugin that cannot be imported
                print(f"error: {user_message(exc)}", file=sys.stderr)
                return EXIT_USER_ERROR
        return 0
    try:
        main(args)
    except LightningPutmError as exc:
        if debug:
            raise
        print(f"error: {user_message(exc)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except InterruptedError as exc:  # SIGTERM during evaluation (evaluation.py polls the trainer's flag)
        print(f"stopped: {exc}", file=sys.stderr)
        return 143
    except OSError as exc:  # permissions, a full disk, a path that is a folder: the environment, not a bug
        if debug:
            raise
        print(f"error: {user_message(exc)} (check the path, its permissions and the free space)", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt as exc:  # Ctrl-C: 128 + SIGINT, the shell's convention
        print(f"interrupted: {exc}" if str(exc) else "interrupted", file=sys.stderr)
        return 130
    return 0
