"""The test harness's eyes inside emulated hosts (tests/emulated_cluster.py): run in a host of its
own, it answers one JSON request per line on stdin with one JSON line on stdout.

    {"op": "status", "cluster": "A,B", "timeout": 2}  -> {"ok": base64(ClusterStatus)} | {"error": "..."}
    {"op": "health", "address": "H:P"}                -> {"ok": true | false}: it says SERVING (leads)
    {"op": "http", "url": "http://H:P/health"}        -> {"ok": body} | {"error": "..."}

The test process itself stays in the machine's own network namespace, where the hosts'
addresses do not exist; gRPC's threads could not follow a setns of one of its threads.
Environment: SHARDLINE_CLUSTER_TOKEN_FILE, the cluster's token.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import urllib.request


def main() -> None:
    from shardline.services.auth import load_token
    from shardline.services.dispatcher_client import DispatcherClient
    from shardline.local_cluster import dispatcher_serving
    from shardline.services.errors import ShardlineError

    token = load_token(os.environ.get("SHARDLINE_CLUSTER_TOKEN_FILE"))
    clients: dict[str, DispatcherClient] = {}
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        try:
            if op == "status":
                client = clients.get(request["cluster"])
                if client is None:
                    client = clients[request["cluster"]] = DispatcherClient(
                        request["cluster"], rpc_timeout=float(request.get("timeout", 2.0)), cluster_token=token)
                reply = {"ok": base64.b64encode(client.cluster_status().SerializeToString()).decode("ascii")}
            elif op == "health":
                reply = {"ok": dispatcher_serving(request["address"])}
            elif op == "http":
                with urllib.request.urlopen(request["url"], timeout=1) as got:
                    reply = {"ok": got.read().decode("utf-8", "replace")}
            else:
                reply = {"error": f"unknown op {op!r}"}
        except (ShardlineError, OSError, ValueError) as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
            for client in clients.values():
                client.reconnect()   # a partition may have just ended: dial afresh
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
