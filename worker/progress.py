"""A dependency-free training progress display.

On a TTY: one line redrawn in place, ``step 120/300 [=====>    ] loss 1.234 tok/s 5.6k v121``.
Otherwise: a plain line (``step 120/300 loss 1.234 tok/s 5.6k v121``) every ``every`` steps and at
the last step. ``close()`` always leaves the cursor on a fresh line and may be called twice.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "format_rate"]


def format_rate(x: float) -> str:
    """1234 -> '1.2k', 5_600_000 -> '5.6M', 12.3 -> '12.3'."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{suffix}"
    return f"{x:.1f}"


class Progress:
    """``update(step, loss=..., tokens_per_s=..., version=...)`` after each step; ``close()`` at the end.

    ``tty=None`` asks ``stream.isatty()``. On a TTY redraws are throttled to one per
    ``min_interval`` seconds (the last step is always drawn).
    """

    def __init__(self, total: int, stream: TextIO | None = None, every: int = 10, tty: bool | None = None,
                 width: int = 24, prefix: str = "", min_interval: float = 0.1):
        self.total = max(int(total), 0)
        self.stream = stream if stream is not None else sys.stderr
        self.every = max(int(every), 1)
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty = tty
        self.width = max(int(width), 1)
        self.prefix = prefix
        self.min_interval = min_interval
        self._last_draw: float | None = None
        self._drawn_len = 0  # length of the partial TTY line on screen (0 = cursor at line start)
        self._last_line = ""
        self._closed = False

    def _bar(self, step: int) -> str:
        if self.total <= 0:
            return ""
        filled = min(self.width, self.width * step // self.total)
        head = ">" if filled < self.width else ""
        return "[" + "=" * filled + head + " " * (self.width - filled - len(head)) + "] "

    def format(self, step: int, loss: float | None = None, tokens_per_s: float | None = None,
               version: int | None = None, bar: bool = False) -> str:
        parts = [f"{self.prefix}step {step}/{self.total}"]
        if bar:
            parts.append(self._bar(step).rstrip())
        if loss is not None:
            parts.append(f"loss {loss:.3f}")
        if tokens_per_s is not None:
            parts.append(f"tok/s {format_rate(tokens_per_s)}")
        if version is not None:
            parts.append(f"v{version}")
        return " ".join(parts)

    def update(self, step: int, loss: float | None = None, tokens_per_s: float | None = None,
               version: int | None = None, tokens: int | None = None) -> None:
        if self._closed:
            return
        last = step >= self.total
        if self.tty:
            now = time.monotonic()
            if not last and self._last_draw is not None and now - self._last_draw < self.min_interval:
                return
            self._last_draw = now
            line = self.format(step, loss, tokens_per_s, version, bar=True)
            pad = " " * max(self._drawn_len - len(line), 0)
            self.stream.write("\r" + line + pad)
            self._drawn_len = len(line)
        elif last or step % self.every == 0:
            line = self.format(step, loss, tokens_per_s, version)
            self.stream.write(line + "\n")
        else:
            return
        self._last_line = line
        self.stream.flush()

    def write(self, message: str) -> None:
        """Print a message on its own line without garbling the TTY progress line."""
        if self.tty and self._drawn_len:
            self.stream.write("\r" + " " * self._drawn_len + "\r" + message + "\n" + "\r" + self._last_line)
        else:
            self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.tty and self._drawn_len:
            self.stream.write("\n")
            self.stream.flush()
        self._drawn_len = 0

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
