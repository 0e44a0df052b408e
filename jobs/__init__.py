"""Jobs: what a worker daemon trains, and the worker daemon (``worker_daemon``, ``shardline-worker``).

``spec`` is the job-file schema, ``runner`` the per-rank training loop, ``models`` the models a job
may name (the built-in TinyGPT, a local Hugging Face directory) and ``data`` what they train on (the
built-in synthetic task, a JSONL file). ``workloads`` pairs a model with its data for the runner.
Hugging Face support (``transformers``, ``peft``) is imported only by jobs that name one.
"""
