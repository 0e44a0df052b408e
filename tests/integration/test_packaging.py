"""The `shardline` distribution: a wheel built from the tree installs one top-level package into a
clean venv, with its generated protobuf modules, and works from anywhere.

The wheel is built from a copy of the tree without any generated modules (as a fresh clone has
it), so the build itself must run protoc. The venv gets torch first, as users install it, and the
wheel must keep that torch (its requirement is a range, never a CUDA build pulled on top). That
torch (with pip and what torch requires) is the one pip installed for the tests' own interpreter
(the Makefile's TORCH_SPEC), hard-linked into the venv rather than unpacked and byte-compiled
again; the wheel and its other requirements are installed by pip as a user's would be.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GENERIC_NAMES = ("services", "worker", "jobs", "dispatcher", "ps_server", "protos")
STEP_TIMEOUT = 600

pytestmark = pytest.mark.slow


def run(argv, *, cwd, timeout=STEP_TIMEOUT, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{' '.join(map(str, argv))} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def tree_copy(dest: Path) -> Path:
    """The files of the tree that git tracks or would track: no venv, no generated modules."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO).stdout
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    assert not list((dest / "services" / "pb").glob("*_pb2*")), "the copy must not carry generated modules"
    return dest


def link_distributions(names, site: Path) -> list[str]:
    """Put the installed distributions ``names`` and everything they require, as pip installed
    them for this interpreter (files, metadata, RECORD), into the ``site`` directory of another
    environment: hard links, copies across file systems. Scripts outside site-packages are left
    out (their shebangs name this interpreter). Returns the distributions' names."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    done: set[str] = set()
    todo = list(names)
    while todo:
        dist = metadata.distribution(todo.pop())
        name = canonicalize_name(dist.metadata["Name"])
        if name in done:
            continue
        done.add(name)
        root = Path(dist.locate_file(""))
        for rel in dist.files or ():
            src, dest = root / rel, site / rel
            if rel.parts[0] == ".." or not src.is_file():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dest)
            except OSError:
                shutil.copy2(src, dest)
        todo += [r.name for r in map(Requirement, dist.requires or ()) if r.marker is None or r.marker.evaluate({"extra": ""})]
    return sorted(done)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, the wheel, a directory outside the tree) after building and installing."""
    root = tmp_path_factory.mktemp("packaging")
    src = tree_copy(root / "src")
    wheels = root / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", wheels, src], cwd=root)
    (wheel,) = wheels.glob("shardline-*.whl")
    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
    python = venv / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).stdout.strip())
    assert "torch" in link_distributions(["pip", "torch"], site)
    before = run([python, "-c", "import torch; print(torch.__version__)"], cwd=root).stdout.strip()
    run([python, "-m", "pip", "install", "-q", wheel], cwd=root)
    after = run([python, "-c", "import torch; print(torch.__version__)"], cwd=root).stdout.strip()
    assert after == before, f"installing the wheel replaced torch {before} with {after}"
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    return python, wheel, elsewhere


def test_wheel_holds_one_top_level_package(installed):
    _python, wheel, _ = installed
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"shardline"}, sorted(tops)
    for module in ("common_pb2.py", "dataplane_pb2.py", "dispatcher_pb2.py", "dispatcher_pb2_grpc.py", "ps_pb2_grpc.py"):
        assert f"shardline/services/pb/{module}" in names, f"the build did not generate {module}"


def test_site_packages_has_no_generic_top_level_names(installed):
    python, _wheel, elsewhere = installed
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=elsewhere).stdout.strip())
    present = [name for name in GENERIC_NAMES if (site / name).exists() or (site / f"{name}.py").exists()]
    assert not present, f"{site} holds generic top-level packages: {present}"
    probe = "import importlib.util, json; print(json.dumps({n: importlib.util.find_spec(n) is not None for n in %r}))"
    found = json.loads(run([python, "-c", probe % (GENERIC_NAMES,)], cwd=elsewhere).stdout)
    assert not any(found.values()), f"importable outside the tree: {found}"


def test_imports_from_outside_the_tree(installed):
    python, _wheel, elsewhere = installed
    code = textwrap.dedent("""
        import json, shardline
        from shardline import PSOptimizer, connect
        from shardline.services.pb import dispatcher_pb2, dataplane_pb2
        import torch
        print(json.dumps({"file": shardline.__file__, "optimizer": PSOptimizer.__module__,
                          "connect": connect.__module__, "version": shardline.__version__}))
    """)
    out = json.loads(run([python, "-c", code], cwd=elsewhere).stdout)
    assert str(REPO) not in out["file"] and "site-packages" in out["file"], out
    assert out["optimizer"] == "shardline.worker.optim" and out["connect"] == "shardline.worker.client"


def test_console_scripts(installed):
    python, _wheel, elsewhere = installed
    bindir = python.parent
    for script in ("shardline-dispatcher", "shardline-ps", "shardline-worker", "shardline"):
        out = run([bindir / script, "--help"], cwd=elsewhere, timeout=60).stdout
        assert "usage:" in out, f"{script} --help printed {out!r}"


def test_installed_cluster_trains(installed):
    """The installed daemons serve a push and a pull end to end (no tree on any path)."""
    python, _wheel, elsewhere = installed
    code = textwrap.dedent("""
        import torch
        from shardline import connect
        from shardline.local_cluster import LocalCluster
        with LocalCluster("cluster") as cluster:
            cluster.start_dispatcher()
            cluster.add_node()
            cluster.wait_for_nodes(1, timeout=30)
            client = connect(cluster.address, job="wheel")
            client.init({"w": torch.ones(4)}, optimizer="sgd", lr=0.5)
            client.push({"w": torch.full((4,), 2.0)})
            print(client.pull(["w"])["w"].tolist())
            client.close()
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = run([python, "-c", code], cwd=elsewhere, timeout=120, env=env).stdout
    assert out.strip().splitlines()[-1] == "[0.0, 0.0, 0.0, 0.0]", out


def test_a_hugging_face_job_without_the_extra_names_it(installed):
    """The wheel alone (no `hf` extra) imports the job modules; a job that needs transformers says
    which extra to install."""
    python, _wheel, elsewhere = installed
    code = textwrap.dedent("""
        import shardline.jobs.runner
        from shardline.jobs.models.hf import require_hf
        from shardline.services.errors import ShardlineConfigError
        try:
            require_hf()
        except ShardlineConfigError as exc:
            print(exc)
    """)
    out = run([python, "-c", code], cwd=elsewhere).stdout
    assert "pip install 'shardline[hf]'" in out, out
