"""`shardline fit-cost`: the job's own model timed on this machine gives a cost line the job-file
schema accepts for length balancing (train.cost)."""

import re
from pathlib import Path

import yaml

from shardline.jobs.cost_fit import measured_lengths
from shardline.jobs.spec import load_job
from shardline import cli

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo_job.yaml"


def test_measured_lengths_are_distinct_and_span_the_range():
    assert measured_lengths(128) == [8, 32, 56, 80, 104, 128]
    small = measured_lengths(3)
    assert len(small) == 6 and small == sorted(set(small)) and small[0] == 8


def test_fit_cost_prints_a_cost_line_the_job_file_takes(tmp_path, capsys):
    assert cli.main(["fit-cost", str(DEMO), "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("cost:"))
    cost = yaml.safe_load(line)["cost"]
    assert set(cost) == {"c0", "c1", "c2"} and all(v >= 0 for v in cost.values()) and any(cost.values())
    job = yaml.safe_load(DEMO.read_text())
    job.setdefault("train", {}).update(balance="tokens", cost=cost)
    path = tmp_path / "balanced.yaml"
    path.write_text(yaml.safe_dump(job))
    spec = load_job(str(path))
    assert spec.train.balance == "tokens"
    assert re.search(r"forward\+backward", out)


def test_fit_cost_reports_a_bad_job_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("job: {name: x}\ntrain: {steps: -1}\n")
    assert cli.main(["fit-cost", str(bad)]) == 2
    assert "steps" in capsys.readouterr().err


def test_fit_cost_times_a_hugging_face_job_up_to_its_max_length(tmp_path, capsys):
    from hf_fixtures import build_tiny_llama, prompt_completion_records, write_jsonl

    build_tiny_llama(tmp_path / "llama")
    write_jsonl(tmp_path / "train.jsonl", prompt_completion_records(8))
    job = tmp_path / "hf.yaml"
    job.write_text("job: {name: hf-cost}\nmodel: {hf_path: llama}\ndata: {path: train.jsonl, max_length: 40}\n"
                   "train: {steps: 2, batch_size: 2}\n")
    assert cli.main(["fit-cost", str(job), "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "8..40 tokens" in out and re.search(r"^cost: \{c0: ", out, re.M)
