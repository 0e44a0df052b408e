"""What every benchmark script does once its arguments are parsed: run, print, write the JSON."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def run_and_report(run, print_table, args, stopped: str = "processes") -> int:
    """``run(args)`` (SIGTERM interrupts it like SIGINT), print its result with ``print_table``
    and write it atomically to ``args.out`` if set. Returns the exit status."""
    def _terminate(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    try:
        result = run(args)
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc or 'SIGINT'}); the benchmark's {stopped} were stopped", file=sys.stderr)
        return 130
    print_table(result)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        os.replace(tmp, out)
        print(f"wrote {out}")
    return 0
