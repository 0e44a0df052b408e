#!/usr/bin/env python3
"""Generate the Python modules of ``protos/*.proto`` into ``services/pb/`` (``shardline.services.pb``).

The build runs this (``setup.py``'s ``build_protos`` step, so ``pip install`` and ``pip wheel`` need
no separate protoc call) and so does ``make protos``. Needs grpcio-tools. The ``.proto`` files are
compiled under the virtual path ``shardline/services/pb/``, so the generated modules import each
other as ``shardline.services.pb.*``. Outputs are replaced only when a ``.proto`` is newer.

    python protos/generate.py [--force]
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile

PROTO_DIR = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(os.path.dirname(PROTO_DIR), "services", "pb")
IMPORT_PATH = "shardline/services/pb"   # where the modules live in the installed package
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[str]:
    return sorted(glob.glob(os.path.join(PROTO_DIR, "*.proto")))


def outputs() -> list[str]:
    names = [os.path.splitext(os.path.basename(p))[0] for p in proto_files()]
    return [os.path.join(OUT_DIR, name + suffix) for name in names for suffix in SUFFIXES]


def up_to_date() -> bool:
    newest_input = max(os.path.getmtime(p) for p in [*proto_files(), __file__])
    return all(os.path.exists(out) and os.path.getmtime(out) >= newest_input for out in outputs())


def generate(force: bool = False) -> list[str]:
    """Compile every ``.proto`` unless the outputs are current. Returns the output paths."""
    if not proto_files():
        raise SystemExit(f"no .proto files in {PROTO_DIR}")
    if not force and up_to_date():
        return outputs()
    import grpc_tools
    from grpc_tools import protoc

    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{IMPORT_PATH}={PROTO_DIR}", f"-I{well_known}",
                f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                *(f"{IMPORT_PATH}/{os.path.basename(p)}" for p in proto_files())]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {PROTO_DIR}/*.proto (command: {' '.join(args)})")
        os.makedirs(OUT_DIR, exist_ok=True)
        generated = os.path.join(tmp, *IMPORT_PATH.split("/"))
        for out in outputs():
            shutil.copyfile(os.path.join(generated, os.path.basename(out)), out + ".tmp")
            os.replace(out + ".tmp", out)  # a reader never sees a half-written module
    return outputs()


if __name__ == "__main__":
    for path in generate(force="--force" in sys.argv[1:]):
        print(os.path.relpath(path))
