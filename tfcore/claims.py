"""Claims that the code checks: every statement the prose makes about a result is printed under
the code that proves it, with a ✓, and raises when it does not hold.

Two kinds of stored output live in this book:

- *exact* values (shapes, ids, counts, equalities, short deterministic computations rounded as
  ``tfcore.setup`` prints them), which nbval compares digit for digit;
- *trajectory* values (anything after a training run, sampling, a long float chain or the
  clock), whose last digits change from one CPU or GPU to another. Those are never compared:
  ``check`` asserts the claim about them with a margin that holds on any machine, and prints the
  value of this run inside ``[this run: ...]``, which ``tests/sanitize.cfg`` masks for nbval.

Some claims are about the embedded checkpoint (all-MiniLM-L6-v2): "the pretrained features
reach 0.90". With another checkpoint (``TFCORE_CHECKPOINT``) they are printed, marked as not
checked, and do not raise, so that every chapter runs on any BERT.
"""

from __future__ import annotations

import textwrap
from numbers import Real

# The book's code column shows about 80 characters: a printed claim wraps to fit it, its
# continuation lines indented by two spaces, and "[this run: ...]" is never broken.
WIDTH = 79


class ClaimError(AssertionError):
    """A claim the book makes did not hold in this run."""


def _fit(first: str, claim: str, shown: str, after: str = "") -> str:
    """``first claim shown after`` wrapped at WIDTH, continuation lines indented by two spaces;
    ``shown`` (the "[this run: ...]" part) is kept whole on one line."""
    text = f"{first} {claim}{shown.replace(' ', chr(0)).replace(chr(0) * 2 + '[', '  [', 1)}{after}"
    lines = textwrap.wrap(text, WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines).replace(chr(0), " ")


def _show(value) -> str:
    if isinstance(value, bool) or not isinstance(value, Real):
        return str(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def check(claim: str, holds, measured=None, *, embedded_only: bool = False) -> None:
    """Print ``✓ claim`` when ``holds`` is true; raise :class:`ClaimError` naming the claim otherwise.

    The printed claim is wrapped at 79 characters (the book's code column), continuation lines
    indented by two spaces; ``[this run: ...]`` is never broken across lines.

    ``measured`` (a number, or a dict of names to numbers) is what this run gave; it is printed
    inside ``[this run: ...]`` so that a reader sees it while nbval ignores its digits.
    ``embedded_only=True`` marks a claim about the embedded checkpoint: with any other checkpoint
    it is printed as not checked instead of raising.

    ``holds`` is one truth value: a bool, or a one-element tensor or array (``(x < y).all()`` for
    many). A string, None or a tensor of several elements is refused with a TypeError: ``"False"``
    is true in Python, and would pass.

    Returns ``None``, so that a cell ending with a check shows only the printed line (a trailing
    ``;`` does not hide a value under nbval, which runs cells without history).
    """
    if not isinstance(claim, str) or not claim.strip():
        raise ValueError("check() needs the claim as a sentence, e.g. check('loss below 0.01', loss < 0.01)")
    count = holds.numel() if hasattr(holds, "numel") else getattr(holds, "size", None)  # torch, numpy
    count = count if isinstance(count, int) else None
    if holds is None or isinstance(holds, (str, bytes)) or (count is not None and count != 1):
        raise TypeError(f"check({claim!r}, holds) needs holds to be one truth value (a bool, or a one-element "
                        f"tensor), got {type(holds).__name__}"
                        f"{'' if count is None else f' of {count} elements'}; for many use (...).all()")
    holds = bool(holds)  # a one-element tensor or numpy bool becomes a plain bool here
    if measured is None:
        shown = ""
    elif isinstance(measured, dict):
        shown = "  [this run: " + ", ".join(f"{k} {_show(v)}" for k, v in measured.items()) + "]"
    else:
        shown = f"  [this run: {_show(measured)}]"
    if embedded_only:
        from .checkpoint import active_checkpoint, is_embedded

        if not is_embedded():
            print(_fit("–", claim, shown, f"  (a claim about the embedded checkpoint; not checked on "
                                          f"{active_checkpoint()})"))
            return None
    if not holds:
        raise ClaimError(f"✗ {claim}{shown}: this claim of the book does not hold in this run")
    print(_fit("✓", claim, shown))
    return None
