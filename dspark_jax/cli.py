"""What every command does with a user's mistake: one line on stderr, exit status 2.

Missing files, bad configs, checkpoints that do not fit and refused requests are raised as
ValueError / FileNotFoundError / FileExistsError / ConnectionError subclasses with a message
that names the problem and the fix; a traceback would only bury it. ``DSPARK_JAX_TRACEBACK=1``
shows the traceback anyway (for bug reports).
"""

from __future__ import annotations

import argparse
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


# Flags shared by the commands, defined here (no jax import) so `--help` stays fast.
DTYPE_CHOICES = ("auto", "float32", "bfloat16")


def add_dtype_argument(ap) -> None:
    """`--dtype auto|float32|bfloat16` for every command that loads a target."""
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                    help="weights and compute dtype of the target (default auto: bfloat16 for a checkpoint stored in "
                         "bfloat16, else float32; an 8B model is 16 GB in bf16, 32 GB in float32)")


def add_mesh_argument(ap, what: str = "request rows over data, KV heads over tensor") -> None:
    """The inference commands' shared --mesh flag (parse it with `parallel.sharding.parse_mesh`)."""
    ap.add_argument("--mesh", default=None, metavar="DATA,FSDP,TENSOR",
                    help=f"run on a device mesh, e.g. 1,1,8: weights laid out by the rules table, {what} "
                         "(default: one device)")


def add_kv_pages_argument(ap) -> None:
    """`--kv-pages NUM,SIZE`: the engine's paged KV cache (`Engine(kv_pages=...)`)."""
    ap.add_argument("--kv-pages", default=None, metavar="NUM,SIZE", type=parse_kv_pages,
                    help="paged KV cache: a pool of NUM pages of SIZE tokens shared by the slots, for the target "
                         "and the drafter (memory for the tokens in use; a request waits until the pool can hold "
                         "its prompt + max tokens). Default: dense caches of slots x max-len")


def add_prefill_chunk_argument(ap, default: int | None) -> None:
    """`--prefill-chunk N`: chunked prefill (`Engine(prefill_chunk=N)`); 0 = prompts prefilled whole."""
    ap.add_argument("--prefill-chunk", type=int, default=default, metavar="N",
                    help="a request joining while others decode has its prompt forwarded N tokens per round, packed "
                         "with the others' verification, instead of a prefill that stalls them; 0 = prefill whole "
                         f"prompts (default {default or 0})")


def prefill_chunk(value) -> int | None:
    """The CLI value as the Engine takes it (0 / None: whole prompts)."""
    if value is not None and value < 0:
        raise ValueError(f"--prefill-chunk {value}: give a number of tokens >= 1, or 0 to prefill prompts whole")
    return int(value) if value else None


def parse_kv_pages(text: str) -> tuple[int, int]:

    try:
        num, size = (int(x) for x in str(text).split(","))
        if num < 1 or size < 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give NUM_PAGES,PAGE_SIZE (both >= 1), e.g. 512,16") from None
    return num, size


def parse_mesh_shape(text: str | None, devices: int) -> tuple[int, int, int]:
    """--mesh DATA,FSDP,TENSOR; None: 1,1,devices (tensor parallel over every device)."""
    text = text or f"1,1,{devices}"
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3:
        raise ValueError(f"--mesh {text!r}: give DATA,FSDP,TENSOR, e.g. 1,1,8")
    return shape


def parse_stages(ap, text: str, known) -> tuple[str, ...]:
    """--stages a,b,...: the named stages in order, or `ap.error` naming the unknown ones."""
    stages = tuple(x for x in text.split(",") if x)
    bad = [x for x in stages if x not in known]
    if bad:
        ap.error(f"unknown stage(s) {', '.join(bad)}; choose from {', '.join(known)}")
    return stages
