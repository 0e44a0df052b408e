"""Every import of our own code names the `shardline` namespace: the wheel installs no `services`,
`worker`, `jobs`, `dispatcher` or `ps_server`, so a bare import would break (or pick up a user's module)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OWN = {"services", "worker", "dispatcher", "ps_server", "protos", "jobs"}


def python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / p for p in listed if (REPO / p).is_file()]


def bare_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"{path.relative_to(REPO)}:{node.lineno}: {name}" for name in names if name.split(".")[0] in OWN]
    return found


def test_no_bare_imports_of_our_packages():
    files = python_files()
    assert len(files) > 50
    offenders = [hit for path in files for hit in bare_imports(path)]
    assert not offenders, "import these through the shardline namespace:\n" + "\n".join(offenders)


def test_package_dir_covers_every_source_package():
    """Each package folder under the mapped roots is listed in pyproject.toml (else the wheel lacks it)."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed = set(config["packages"])
    for name, folder in config["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            package = ".".join([name, *rel.parts])
            assert package in listed, f"{init.parent} is package {package}, missing from [tool.setuptools] packages"


def test_jobs_is_a_package_of_its_own():
    """The job runner, models and data live in `jobs/` (shardline.jobs); `worker/` keeps the client
    library and the daemon, which uses them."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert config["package-dir"]["shardline.jobs"] == "jobs"
    for package in ("shardline.jobs", "shardline.jobs.models", "shardline.jobs.data"):
        assert package in config["packages"], package
    for module in ("spec.py", "runner.py", "workloads.py", "models/tinygpt.py", "models/hf.py",
                   "data/batch.py", "data/synthetic.py", "data/jsonl.py"):
        assert (REPO / "jobs" / module).is_file(), module
    assert not {"job.py", "model.py", "tasks.py"} & {p.name for p in (REPO / "worker").iterdir()}


def test_hugging_face_is_imported_lazily():
    """Importing the job modules (as every worker daemon does) loads neither transformers nor peft."""
    import sys

    code = ("import sys, shardline.jobs.runner, shardline.jobs.spec, shardline.jobs.models.hf, shardline.jobs.data.jsonl, "
            "shardline.jobs.worker_daemon; print(sorted(m for m in ('transformers', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
