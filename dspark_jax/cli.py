"""What every command does with a user's mistake: one line on stderr, exit status 2.

Missing files, bad configs, checkpoints that do not fit and refused requests are raised as
ValueError / FileNotFoundError / FileExistsError / ConnectionError subclasses with a message
that names the problem and the fix; a traceback would only bury it. ``DSPARK_JAX_TRACEBACK=1``
shows the traceback anyway (for bug reports).
"""

from __future__ import annotations

import functools
import os
import sys

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, ConnectionError)


def report_user_errors(main):
    """Decorate a ``main(argv) -> int``: user errors become ``error: <message>`` and status 2."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except USER_ERRORS as e:
            if os.environ.get("DSPARK_JAX_TRACEBACK"):
                raise
            print(f"error: {e}", file=sys.stderr)
            return 2

    return wrapped
