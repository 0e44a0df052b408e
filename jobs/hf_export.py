"""A job's tensors as a Hugging Face directory: a ``save_pretrained`` model, or a peft LoRA adapter.

    exporter = HFExporter("models/llama", "out/llama-sft")        # checks the source and OUT first
    result = exporter.write(tensors)                              # {name: tensor} of the job
    result = exporter.write(tensors, lora_alpha=32, lora_dropout=0.05)   # a LoRA job

The job's tensor names are what the worker registered: ``model.named_parameters()`` of
``AutoModelForCausalLM.from_pretrained(DIR)`` (jobs/models/hf.py), tied weights once (the tied
head is not a tensor of the job), and for a LoRA job the peft-wrapped model's names
(``base_model.model.<name>``, ``.base_layer`` in the targeted modules, the adapters as
``<module>.lora_A.<adapter>.weight``).

- Full fine-tune: the job's tensors must be exactly the source model's parameters (names and
  shapes; the first mismatch is named). They are written with ``save_pretrained`` (weights, sharded
  as transformers does, and config.json with the export dtype), and every other top-level file of
  the source directory that is not weights (tokenizer files, chat template, generation_config.json)
  is copied. The default dtype is the source model's (config ``dtype``).
- LoRA: detected by ``lora_A``/``lora_B`` tensors. The frozen base must be the source model's
  (names, shapes, and values, at the precision the job ran in). ``adapter_model.safetensors``
  holds the adapters under peft's keys (the adapter name stripped) and ``adapter_config.json``
  is rebuilt: r and target_modules from the adapter shapes, lora_alpha and lora_dropout from the
  caller (the cluster does not record them: the job file's ``lora:`` section, or flags),
  base_model_name_or_path the source directory, task_type CAUSAL_LM. The tokenizer files are
  copied. The default dtype is float32 (the adapters' masters).

``transformers``/``peft`` load on first use (the extra ``shardline[hf]``); nothing is downloaded.
The output directory is written next to its final place and renamed into it: it must not exist
or be empty.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardline.jobs.models.hf import require_hf
from shardline.services.errors import ShardlineConfigError, ShardlineError
from shardline.worker.flat_params import is_flat_name, unflatten

__all__ = ["HFExporter", "HFExport", "HFExportError", "is_lora", "WEIGHT_FILE"]

WHAT = "shardline export --hf-dir"
# Files of a model directory that hold weights (they are never copied).
WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf|onnx)$|.*\.(safetensors|bin)\.index\.json$")
# Files save_pretrained writes for the model itself (LoRA exports do not copy them: they are the base's).
MODEL_FILES = ("config.json", "generation_config.json")
# <module>.lora_A.<adapter>[.weight]: peft's parameter names of an adapter (Linear and Embedding).
_ADAPTER = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)\.(?P<adapter>[^.]+)"
                      r"(?P<rest>\.weight)?$")
PEFT_PREFIX = "base_model.model."
LORA_DEFAULT_DTYPE = torch.float32


class HFExportError(ShardlineError):
    """The job's tensors do not fit the source model, or the output cannot be written."""


@dataclass
class HFExport:
    kind: str                  # "model" or "lora"
    out: Path
    dtype: torch.dtype
    tensors: int               # tensors written
    parameters: int            # elements written
    files: list[str] = field(default_factory=list)
    adapter_config: dict[str, Any] | None = None


def is_lora(names) -> bool:
    """A LoRA job: some tensor is a peft adapter (``...lora_A.<adapter>.weight``)."""
    return any(_ADAPTER.match(n) for n in names)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class HFExporter:
    """Checks the source model directory and the output directory (before any tensor is fetched),
    then :meth:`write` exports a job's tensors."""

    def __init__(self, from_model: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype | None = None):
        self.source = Path(from_model).resolve()
        self.out = Path(out_dir)
        self.dtype = dtype
        if not self.source.is_dir():
            raise ShardlineConfigError(f"--from-model {str(from_model)!r} is not a directory "
                                       f"(a local save_pretrained model)")
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise ShardlineConfigError(f"--hf-dir {str(out_dir)!r} exists and is not an empty directory; remove it "
                                       f"or name another")
        (self.transformers,) = require_hf("transformers", what=WHAT)
        self.transformers.utils.logging.disable_progress_bar()
        try:
            self.config = self.transformers.AutoConfig.from_pretrained(str(self.source), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ShardlineConfigError(f"--from-model: cannot load a model config from {str(self.source)!r}: "
                                       f"{exc}") from None
        source_dtype = getattr(self.config, "dtype", None)
        self.source_dtype = source_dtype if isinstance(source_dtype, torch.dtype) else torch.float32
        self._skeleton: torch.nn.Module | None = None

    # -- the source model -------------------------------------------------------------------------
    def skeleton(self) -> torch.nn.Module:
        """The source architecture on the meta device (no memory, no weights read)."""
        if self._skeleton is None:
            with torch.device("meta"):
                try:
                    self._skeleton = self.transformers.AutoModelForCausalLM.from_config(self.config)
                except (OSError, ValueError) as exc:
                    raise ShardlineConfigError(f"--from-model: {str(self.source)!r} is not a causal LM: "
                                               f"{exc}") from None
        return self._skeleton

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """What a worker registers for a full fine-tune of the source model: its named_parameters."""
        return {n: tuple(p.shape) for n, p in self.skeleton().named_parameters()}

    def _check(self, have: dict[str, tuple[int, ...]], what: str) -> None:
        want = self.parameter_shapes()
        for name, shape in want.items():
            if name not in have:
                raise HFExportError(f"{what} lack tensor {name!r} {list(shape)} of the model in {str(self.source)!r} "
                                    f"(was the job trained on another model?)")
            if have[name] != shape:
                raise HFExportError(f"{what}: tensor {name!r} is {list(have[name])}, the model in {str(self.source)!r} "
                                    f"has {list(shape)} (was the job trained on another model?)")
        extra = [n for n in have if n not in want]
        if extra:
            raise HFExportError(f"{what} have tensor {extra[0]!r} {list(have[extra[0]])}, which the model in "
                                f"{str(self.source)!r} does not (was the job trained on another model?)")

    # -- writing -----------------------------------------------------------------------------------
    def write(self, tensors: dict[str, torch.Tensor], *, lora_alpha: float | None = None,
              lora_dropout: float | None = None, lora: Any = None,
              metadata: dict[str, str] | None = None) -> HFExport:
        """Export ``tensors`` (a job's, by the worker's names). ``lora``: the job file's LoraSpec,
        if known (its alpha and dropout unless given, and its r and target_modules are checked);
        ``metadata`` goes into the safetensors header of a LoRA adapter file."""
        tensors = self._unflattened(tensors)
        if is_lora(tensors):
            return self._write_lora(tensors, lora_alpha, lora_dropout, lora, metadata or {})
        if lora_alpha is not None or lora_dropout is not None or lora is not None:
            raise ShardlineConfigError("the job has no LoRA adapters (full fine-tune): LoRA options do not apply")
        return self._write_model(tensors)

    def _unflattened(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A job trained with ``flatten=True`` holds one flat tensor (worker/flat_params.py) where a
        full fine-tune of one param group (what a job file trains) made it of every parameter of the
        model, in order: split back into them. Anything else flat is refused, saying why."""
        flats = [n for n in tensors if is_flat_name(n)]
        if not flats:
            return tensors
        members = [(n, shape) for n, shape in self.parameter_shapes().items() if n not in tensors]
        if len(flats) > 1:
            raise HFExportError(f"the job stores {len(flats)} flat parameter groups ({', '.join(sorted(flats))}): "
                                f"export rebuilds the parameters of a job trained with flatten=True from one group only")
        try:
            parts = unflatten(flats[0], tensors[flats[0]], members)
        except ValueError as exc:
            raise HFExportError(f"the job's {exc}: was it trained on the model in {str(self.source)!r}, with every "
                                f"parameter in one group?") from None
        return {**{n: t for n, t in tensors.items() if n != flats[0]}, **parts}

    def _staging(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(f".{self.out.name}.tmp.{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp

    def _place(self, tmp: Path) -> list[str]:
        if self.out.exists():
            self.out.rmdir()  # empty (checked at the start); a file put there meanwhile fails here
        os.replace(tmp, self.out)
        return sorted(p.name for p in self.out.iterdir())

    def _copy_files(self, dest: Path, skip: tuple[str, ...] = ()) -> None:
        """Every top-level file of the source that is not weights (tokenizer, templates, configs)."""
        for p in sorted(self.source.iterdir()):
            if p.is_file() and not p.name.startswith(".") and not WEIGHT_FILE.match(p.name) and p.name not in skip:
                shutil.copy2(p, dest / p.name)

    def _write_model(self, tensors: dict[str, torch.Tensor]) -> HFExport:
        self._check({n: tuple(t.shape) for n, t in tensors.items()}, "the job's tensors")
        dtype = self.dtype or self.source_dtype
        model = self.skeleton()
        state = {n: t.detach().to(dtype).contiguous() for n, t in tensors.items()}
        model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()  # a tied head follows the (assigned) embedding again
        self._fill_buffers(model, dtype)
        model.config.dtype = dtype
        tmp = self._staging()
        try:
            self._copy_files(tmp, skip=("config.json",))
            generation = tmp / "generation_config.json"
            kept = generation.read_bytes() if generation.exists() else None
            model.save_pretrained(str(tmp))
            if kept is not None:  # the source's own generation settings, not ones derived from config
                generation.write_bytes(kept)
            files = self._place(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            self._skeleton = None  # it holds the tensors now
        return HFExport("model", self.out, dtype, len(state), sum(t.numel() for t in state.values()), files)

    def _fill_buffers(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        """Persistent buffers (saved state that is not a parameter, so not a tensor of the job)
        come from the source's weight files."""
        wanted = [n for n, t in model.state_dict().items() if t.is_meta]
        if not wanted:
            return
        from safetensors import safe_open

        found: dict[str, torch.Tensor] = {}
        for path in sorted(self.source.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for key in set(wanted).intersection(f.keys()):
                    found[key] = f.get_tensor(key)
        missing = [n for n in wanted if n not in found]
        if missing:
            raise HFExportError(f"the model in {str(self.source)!r} has saved state {missing[0]!r} that is not a "
                                f"parameter (so not a tensor of the job) and is not in its safetensors files")
        for name, value in found.items():
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            module.register_buffer(attr, value.to(dtype) if value.is_floating_point() else value, persistent=True)

    def _write_lora(self, tensors: dict[str, torch.Tensor], alpha: float | None, dropout: float | None,
                    lora: Any, metadata: dict[str, str]) -> HFExport:
        adapters: dict[str, torch.Tensor] = {}
        base: dict[str, torch.Tensor] = {}
        names: set[str] = set()
        ranks: dict[str, int] = {}
        for name, t in tensors.items():
            m = _ADAPTER.match(name)
            if m is None:
                if not name.startswith(PEFT_PREFIX):
                    raise HFExportError(f"the LoRA job's tensor {name!r} is not under {PEFT_PREFIX!r} (peft's names)")
                base[name[len(PEFT_PREFIX):].replace(".base_layer.", ".")] = t
                continue
            names.add(m["adapter"])
            adapters[f"{m['module']}.{m['kind']}{m['rest'] or ''}"] = t
            if m["kind"] in ("lora_A", "lora_embedding_A"):
                ranks[m["module"]] = int(t.shape[0])
        if len(names) > 1:
            raise HFExportError(f"the job has several LoRA adapters ({', '.join(sorted(names))}); export one per job")
        if len(set(ranks.values())) != 1:
            raise HFExportError(f"the job's adapters have different ranks ({sorted(set(ranks.values()))}); only one r "
                                f"is supported")
        r = next(iter(ranks.values()))
        targets = sorted({module.rpartition(".")[2] for module in ranks})
        self._check({n: tuple(t.shape) for n, t in base.items()}, "the LoRA job's base tensors")
        self._check_base_values(base)
        if lora is not None:
            want = lora.target_modules
            want = sorted([want] if isinstance(want, str) else want) if want is not None else None
            if lora.r != r or (want is not None and want != targets):
                raise HFExportError(f"the job file's lora section (r {lora.r}, target_modules {want}) does not "
                                    f"match the job's adapters (r {r}, target_modules {targets})")
            alpha = lora.alpha if alpha is None else alpha
            dropout = lora.dropout if dropout is None else dropout
        if alpha is None:
            raise ShardlineConfigError("the cluster does not record the LoRA alpha of a job: pass --lora-alpha, or "
                                       "--job-file with the job's lora section")
        (peft,) = require_hf("peft", what=WHAT)
        config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0 if dropout is None else dropout,
                                 target_modules=targets, task_type="CAUSAL_LM",
                                 base_model_name_or_path=str(self.source))
        dtype = self.dtype or LORA_DEFAULT_DTYPE
        state = {k: t.detach().to(dtype).contiguous() for k, t in sorted(adapters.items())}
        from safetensors.torch import save_file

        tmp = self._staging()
        try:
            self._copy_files(tmp, skip=MODEL_FILES)
            config.save_pretrained(str(tmp))
            save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt", **metadata})
            files = self._place(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        written = json.loads((self.out / "adapter_config.json").read_text(encoding="utf-8"))
        return HFExport("lora", self.out, dtype, len(state), sum(t.numel() for t in state.values()), files, written)

    def _check_base_values(self, base: dict[str, torch.Tensor]) -> None:
        """The frozen base of a LoRA job never changes: it must be the source model's weights (at
        the precision the job ran in: a bf16 job holds them rounded to bf16)."""
        try:
            model = self.transformers.AutoModelForCausalLM.from_pretrained(str(self.source), local_files_only=True,
                                                                            dtype=self.source_dtype)
        except (OSError, ValueError) as exc:
            raise ShardlineConfigError(f"--from-model: cannot load the model in {str(self.source)!r}: {exc}") from None
        rtol = 2.0 ** -7  # bf16 rounding, the coarsest a job runs in
        for name, p in model.named_parameters():
            src, job = p.detach().float(), base[name].float()
            if not torch.allclose(job, src, rtol=rtol, atol=1e-6):
                diff = (job - src).abs().max().item()
                raise HFExportError(f"the LoRA job's frozen base tensor {name!r} differs from the model in "
                                    f"{str(self.source)!r} (max abs difference {diff:.3g}): was the job trained on "
                                    f"another model?")
