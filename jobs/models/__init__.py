"""Models a job trains: ``tinygpt`` (built in) and ``hf`` (a local Hugging Face directory, optional LoRA)."""
