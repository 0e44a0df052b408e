"""``shardline-dispatcher``: the dispatcher daemon (dispatcher/main.py), or with ``--cache-bytes`` a
rack cache (rack_cache/daemon.py).

The one module that knows both roles: the dispatcher's and the rack cache's packages do not
import each other (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import sys

from shardline.dispatcher import main as dispatcher_main
from shardline.rack_cache import daemon as rack_cache_daemon


def main(argv: list[str] | None = None) -> int:
    return dispatcher_main.main(argv, cache_role=rack_cache_daemon)


if __name__ == "__main__":
    sys.exit(main())
