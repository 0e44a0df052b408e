"""Training data of a job: ``synthetic`` (the built-in SFT task) and ``jsonl`` (a JSONL file); both
produce ``batch.Batch``es."""
