"""Hugging Face interoperability: `moetrain export-hf CHECKPOINT OUT_DIR` and `import-hf`.

A moetrain checkpoint becomes a directory that `transformers` loads offline with a *native* class
(src/moetrain/hf/arch.py): safetensors weights, config.json, generation_config.json, the tokenizer
files and a model card. `--remote-code` exports any learned-routing model with grouped-query
attention under moetrain's own names, with its modeling file (src/moetrain/hf/modeling_moetrain.py)
and an `auto_map` (`trust_remote_code=True`).

Memory: the export never builds the model. It reads the checkpoint's config and DCP index, plans
the files, and fills each shard from the DCP files a group of entries at a time (at most
min(shard size, `READ_BYTES`)), appending each converted tensor to the file as it comes: peak ≈
one read group plus one tensor, whatever the model's size. Under torchrun each rank writes every
N-th shard (rank 0 also the index, config and tokenizer files): the directory is complete when
every rank has finished.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moetrain import __version__
from moetrain.config import load_yaml
from moetrain.data.progress import Progress
from moetrain.destinations import check_directory, check_free_space, existing_entries
from moetrain.errors import CheckpointError, ConfigError, DataError, require
from moetrain.hf.arch import (
    REMOTE_MODULE,
    Architecture,
    HfTensor,
    architecture_for,
    hf_config,
    model_config_from_hf,
    refusal,
    remote_config,
    remote_problems,
    remote_tensor_plan,
    rope_rows_from_interleaved,
    tensor_plan,
    unsupported_features,
)
from moetrain.hf.shards import (
    INDEX,
    ShardWriter,
    index_json,
    nbytes,
    parse_size,
    remove_stale,
    shard_names,
    split_into_shards,
)
from moetrain.inference import checkpoint_config, checkpoint_tokenizer
from moetrain.model.counting import count_params
from moetrain.parallel.distributed import from_rank_0
from moetrain.plan.hardware import refuse_unless_it_fits
from moetrain.train.checkpoint_index import SafeFileSystemReader
from moetrain.train.checkpoint_io import model_state_dict, save_weights
from moetrain.train.config import RunConfig
from moetrain.train.metrics import read_metrics
from moetrain.train.run_dir import check_weights_destination, resolve_checkpoint
from moetrain.version import code_version

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
READ_BYTES = 1 << 30
"""At most this many bytes of checkpoint entries are read at once (and at most one shard's)."""
TRAINING_CONFIG = "moetrain_config.yaml"
"""The run's whole config, written beside an export: what `import-hf` takes the training set-up
(sequence length, batch, optimizer, schedule) from when the model comes back."""
EXPORT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
    INDEX,
    f"{REMOTE_MODULE}.py",
    TRAINING_CONFIG,
)
"""What an export writes besides its safetensors files (`export_replaces`)."""
IMPORT_FILES = ("config.yaml", "tokenizer.json")
"""What an import writes besides its checkpoint."""
EMBEDDING = "model.embed_tokens.weight"
UNTIED = (
    "import-hf: tie_word_embeddings=true, but moetrain's LM head is its own matrix: it starts as a copy of the "
    "embedding (the same logits) and trains apart from it."
)
NO_TOKENIZER = (
    "import-hf: {} has no tokenizer.json, so neither has the checkpoint: eval and generate need one, and data for "
    "it must be prepared with the model's own (prepare-data --tokenizer). Save it with transformers' "
    "AutoTokenizer.from_pretrained(HF_DIR).save_pretrained(DIR) and copy DIR/tokenizer.json into OUT_DIR and its "
    "checkpoints/step-0."
)
PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""Weight files that are pickles, which import-hf never opens (loading a pickle can run code)."""
SAFETENSORS_ONLY = (
    "Convert them where you trust them, e.g. `AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR)` "
    "with transformers (which writes safetensors), then import NEW_DIR."
)


def export_replaces(out_dir: str | Path) -> list[str]:
    """The files of `out_dir` an export would replace or remove (an earlier export's)."""
    return existing_entries(out_dir, EXPORT_FILES, lambda n: n.endswith(".safetensors"))


def import_replaces(out_dir: str | Path) -> list[str]:
    """The files of `out_dir` an import would replace (its checkpoints are refused anyway)."""
    return existing_entries(out_dir, IMPORT_FILES)


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "bfloat16",
    max_shard_size: str | int = "5GB",
    max_position_embeddings: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    license_id: str = "other",
    remote_code: bool = False,
) -> dict:
    """Write the HF directory (this rank's shards of it); returns a summary (architecture,
    dtype, files, tensors, parameters, bytes)."""
    safe_open = require("safetensors", "export-hf (it writes and checks safetensors)").safe_open  # before any work
    check_directory(out_dir, "Output directory", "Pass an OUT_DIR you can write")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}.")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", license_id):
        raise ConfigError(
            f"--license={license_id!r} is not a Hub license id: lowercase letters, digits, '.', '-' and '+' "
            "(apache-2.0, mit, cc-by-4.0, llama3.1, other, …)."
        )
    max_bytes = parse_size(max_shard_size)
    path = resolve_checkpoint(checkpoint)
    cfg, tokenizer = checkpoint_config(path), checkpoint_tokenizer(path, "to export with the model")
    positions = max_position_embeddings if max_position_embeddings is not None else cfg.data.seq_len
    if positions <= 0:
        raise ConfigError(f"--max-position-embeddings={positions} must be positive (default: data.seq_len).")
    m = cfg.model
    source = CheckpointEntries(path, m)
    plan = _plan(m, source, remote_code)
    out_dtype = DTYPES[dtype]
    specs = [(t.name, torch.float32 if t.keep_fp32 else out_dtype, source.hf_shape(t)) for t in plan]
    shards = split_into_shards(specs, max_bytes)
    names = shard_names(len(shards))
    parameters = sum(math.prod(spec[2]) for t, spec in zip(plan, specs) if t.parameter)
    by_name = {t.name: t for t in plan}

    out = Path(out_dir)
    shard_bytes = [sum(map(nbytes, shard)) for shard in shards]
    check_free_space(
        out,
        sum(shard_bytes[rank::world_size]),  # this rank's shards
        "Output directory",
        f"the export's {'shards' if len(shards) > 1 else 'weights'} in {dtype}"
        + (f" (rank {rank}'s share)" if world_size > 1 else ""),
        "Free space or pass an OUT_DIR on another filesystem",
    )
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:  # an earlier export's config.json goes first: until the new one is written last,
        (out / "config.json").unlink(missing_ok=True)  # the directory is no model to transformers or import-hf
        remove_stale(out, names)
    from_rank_0(None)  # under a process group the other ranks write once those are gone
    mine = range(rank, len(shards), world_size)
    bar = Progress(len(mine), True, "exporting" + f" (rank {rank})" * (world_size > 1), "shards")
    for i in mine:
        _write_shard(out / names[i], [by_name[s[0]] for s in shards[i]], shards[i], source, max_bytes)
        with safe_open(str(out / names[i]), framework="pt") as f:  # the library reads back what we wrote
            assert len(f.keys()) == len(shards[i]), names[i]
        bar.update(1, shard_bytes[i])
    bar.close()
    if rank == 0:
        _wait_for_shards(out, names, world_size)
        if len(shards) > 1:
            (out / INDEX).write_text(json.dumps(index_json(shards, names, parameters), indent=2) + "\n")
        _write_readme(out, path, cfg, dtype, parameters, license_id, remote_code)
        _write_metadata(out, cfg, tokenizer, positions, dtype, remote_code)
    return {
        "architecture": "MoetrainForCausalLM" if remote_code else architecture_for(m).value,
        "remote_code": remote_code,
        "out_dir": str(out),
        "dtype": dtype,
        "files": names,
        "tensors": len(plan),
        "parameters": parameters,
        "bytes": sum(shard_bytes),
        "max_position_embeddings": positions,
    }


def _plan(m, source: CheckpointEntries, remote_code: bool) -> list[HfTensor]:
    """The export's tensors: moetrain's own names for `--remote-code`, else the native class's;
    what the chosen form cannot represent is refused, naming it."""
    if remote_code:
        if remote_problems(m):
            raise ConfigError("This model is not exported: " + "; ".join(remote_problems(m)) + ".")
        return remote_tensor_plan(list(source.meta))
    bias_nonzero, qwen = False, architecture_for(m) == Architecture.qwen3_moe
    if qwen:
        biases = source.read([f"blocks.{i}.ffn.router.expert_bias_E" for i in range(m.num_dense_layers, m.n_layers)])
        bias_nonzero = any(bool(b.abs().max() > 0) for b in biases.values())
    problems = unsupported_features(m, bias_nonzero)
    if problems:
        raise ConfigError(refusal(m, problems))
    plan = tensor_plan(m)
    read = {t.entry for t in plan if t.entry}
    # Left out by design: the MTP modules, and Qwen3-MoE's selection biases (all zero, checked above).
    left = [e for e in source.meta if not (e.startswith("mtp.") or (qwen and e.endswith("expert_bias_E")))]
    if lost := [e for e in left if e not in read] + [e for e in read if e not in source.meta]:
        raise ConfigError(
            f"export-hf's {architecture_for(m).value} plan does not map the checkpoint's entries {', '.join(lost[:3])}"
            f"{' …' if len(lost) > 3 else ''}: a model option unsupported_features (src/moetrain/hf/arch.py) "
            "neither refuses nor tensor_plan exports. Export with --remote-code, or see docs/extending.md."
        )
    return plan


def _write_shard(path: Path, tensors: list[HfTensor], specs, source: CheckpointEntries, max_bytes: int) -> None:
    """One file: its entries read in groups of at most min(max_bytes, READ_BYTES), each tensor
    converted and appended as soon as its group is in memory."""
    writer = ShardWriter(path, specs, {"format": "pt", "exported_by": "moetrain export-hf"})
    budget = min(max_bytes, READ_BYTES)
    group: list[int] = []  # indices into `tensors` whose entries are read together

    def flush() -> None:
        entries = source.read(list(dict.fromkeys(tensors[j].entry for j in group if tensors[j].entry)))
        for j in group:
            t, (name, dtype, shape) = tensors[j], specs[j]
            if not t.entry:  # zero-width (GLM-4-MoE's shared expert where there is none)
                value = torch.empty(shape, dtype=dtype)
            else:
                value = entries[t.entry]
                value = value[t.rows[0] : t.rows[1]] if t.rows else value
                value = value.float() * t.scale if t.scale != 1.0 else value
            writer.write(name, value.to(dtype))
        group.clear()

    size, last_entry = 0, None
    for j, t in enumerate(tensors):
        n = source.entry_bytes(t.entry) if t.entry and t.entry != last_entry else 0
        # Tensors of one entry (an expert's gate and up halves) are read together.
        if group and n and size + n > budget:
            flush()
            size = 0
        group.append(j)
        size, last_entry = size + n, t.entry
    flush()
    writer.close()


class CheckpointEntries:
    """Named model entries of a DCP checkpoint, read a few at a time (no model is built): their
    shapes from the index, their values through DCP (which reads each stored chunk once and
    copies it into place, whichever layout wrote it)."""

    def __init__(self, path: Path, m):
        self.path = path
        self.reader = _CachedReader(str(path))
        try:
            stored = self.reader.read_metadata().state_dict_metadata
        except Exception as e:  # noqa: BLE001 (any unreadable index is the same user error)
            raise CheckpointError(f"Checkpoint '{path}' has no readable DCP index (.metadata): {e}.") from None
        self.meta: dict[str, TensorStorageMetadata] = {}
        for name, t in model_state_dict(m.build(device="meta")).items():  # the entries m has, no memory
            md, want = stored.get(f"model.{name}"), tuple(t.shape)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != want:
                found = f"shape {tuple(md.size)}" if isinstance(md, TensorStorageMetadata) else "nothing"
                raise CheckpointError(
                    f"Checkpoint '{path}' does not match its config.yaml: entry model.{name} should have shape "
                    f"{want} but holds {found}. Export the checkpoint directory that was written with this config."
                )
            self.meta[name] = md

    def hf_shape(self, t: HfTensor) -> tuple[int, ...]:
        if not t.entry:
            return t.empty_shape
        shape = tuple(self.meta[t.entry].size)
        return (t.rows[1] - t.rows[0], *shape[1:]) if t.rows else shape

    def entry_bytes(self, name: str) -> int:
        md = self.meta[name]
        return math.prod(md.size) * md.properties.dtype.itemsize

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        if not names:
            return {}
        state = {
            "model": {n: torch.empty(tuple(self.meta[n].size), dtype=self.meta[n].properties.dtype) for n in names}
        }
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                dcp.load(state, storage_reader=self.reader, planner=DefaultLoadPlanner(), no_dist=True)
        except (Exception, CheckpointException) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CheckpointError(f"Reading checkpoint '{self.path}' failed: {first}.") from None
        return state["model"]


class _CachedReader(SafeFileSystemReader):
    """The checkpoint's DCP reader, reading its index once for all the groups of an export."""

    _metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


def _wait_for_shards(out: Path, names: list[str], world_size: int, timeout_s: float = 3600.0) -> None:
    """Under torchrun the other ranks write their shards (each appears whole, renamed from a
    temporary name): wait until all are there before the files that name them, or stop, saying
    which are missing, when a rank has not written its shard after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while missing := [n for n in names if not (out / n).is_file()]:
        if world_size == 1 or time.monotonic() > deadline:
            raise CheckpointError(
                f"export-hf: {', '.join(missing)} not written into {out} (their ranks stopped?): the export is "
                "incomplete and has no config.json. Run export-hf again with --force."
            )
        time.sleep(1.0)


def _write_metadata(out: Path, cfg: RunConfig, tokenizer, positions: int, dtype: str, remote: bool) -> None:
    """generation_config.json, the tokenizer files (and, with `remote`, the modeling file
    transformers runs), then config.json, the export's last file, written whole or not at all
    (renamed from a temporary name): a directory with it holds every other file of the export."""
    eos_id = tokenizer.token_to_id("<|endoftext|>")
    generation = {"bos_token_id": eos_id, "eos_token_id": eos_id, "do_sample": False}
    if remote:
        generation["use_cache"] = False
        shutil.copyfile(Path(__file__).with_name(f"{REMOTE_MODULE}.py"), out / f"{REMOTE_MODULE}.py")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out / TRAINING_CONFIG).write_text(cfg.to_yaml())
    tokenizer.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": positions,
        "clean_up_tokenization_spaces": False,
    }
    if eos_id is not None:
        tok_cfg.update(eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    config = (remote_config if remote else hf_config)(cfg.model, eos_id, positions, dtype)
    partial = out / "config.json.tmp"
    partial.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(partial, out / "config.json")


def _write_readme(
    out: Path, checkpoint: Path, cfg: RunConfig, dtype: str, parameters: int, license_id: str, remote: bool
) -> None:
    """README.md, a Hugging Face model card: the Hub's metadata block, what the model is and how it
    was trained, how to load it, and what the export leaves out."""
    m = cfg.model
    arch = "MoetrainForCausalLM" if remote else architecture_for(m).value
    model_type = "moetrain" if remote else architecture_for(m).name
    counts = count_params(m)
    run_dir = checkpoint.parent.parent
    step, tokens = _trained(checkpoint, cfg)
    val = _validation_loss(run_dir, step)
    unset = (
        " (none chosen at export: `moetrain export-hf --license ID` sets the Hub's id)" if license_id == "other" else ""
    )
    lines = [
        "---",
        "library_name: transformers",
        f"license: {license_id}",
        "pipeline_tag: text-generation",
        "tags:",
        "- moetrain",
        *["- mixture-of-experts"] * bool(m.num_moe_layers),
        f"- {model_type}",
        *(["- custom_code"] if remote else []),
        "---",
        "",
        f"# {run_dir.name} ({checkpoint.name})",
        "",
        f"A {'mixture-of-experts' if m.num_moe_layers else 'dense'} language model trained with moetrain and "
        f"exported as {arch} ({model_type}), {dtype} weights"
        + (
            f", with moetrain's own modeling file ({REMOTE_MODULE}.py): no native transformers class computes "
            "this model exactly, so it loads with `trust_remote_code=True`."
            if remote
            else "."
        ),
        "",
        "| | |",
        "|---|---|",
        f"| shape | {m.n_layers} layers ({m.num_dense_layers} dense), d_model {m.d_model}, {m.n_heads} heads "
        f"({'latent attention' if m.is_mla else f'{m.n_kv_heads} key/value'}), "
        + (f"{m.moe.num_experts} experts, top-{m.moe.top_k} {m.moe.gating.value} routing, " * bool(m.num_moe_layers))
        + f"vocabulary {m.vocab_size:,} |",
        f"| parameters | {counts.total:,} total, {counts.active:,} active per token ({parameters:,} exported) |",
        f"| trained | {step:,} steps, {tokens:,} tokens (sequences of {cfg.data.seq_len:,}) |",
        f"| data | {', '.join(_source_names(cfg))} |",
        f"| validation loss | {f'{val[1]:.4f} nats per token at step {val[0]:,}' if val else 'not evaluated'} |",
        f"| exported by | moetrain {__version__} (commit {code_version()}) from `{checkpoint}` |",
        f"| license | {license_id}{unset} |",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model = AutoModelForCausalLM.from_pretrained("{out.name}"{", trust_remote_code=True" if remote else ""})',
        f'tokenizer = AutoTokenizer.from_pretrained("{out.name}")',
        "```",
    ]
    if m.mtp_depth:
        lines += [
            "",
            "## Not included",
            "",
            f"The run trained {m.mtp_depth} multi-token prediction module{'s' if m.mtp_depth > 1 else ''} "
            f"(model.mtp_depth={m.mtp_depth}) beside the model. They serve training only and are not part of this "
            "export; the moetrain checkpoint keeps them.",
        ]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def _trained(checkpoint: Path, cfg: RunConfig) -> tuple[int, int]:
    """(steps, tokens) the checkpoint was trained for: its trainer state's step and the loader's
    sequences drawn × sequence length (0, 0 for a weights-only checkpoint without them)."""
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return 0, 0
    sequences = (state.get("loader") or {}).get("sample_index", state.get("step", 0) * cfg.train.global_batch_size)
    return int(state.get("step", 0)), int(sequences) * cfg.data.seq_len


def _validation_loss(run_dir: Path, step: int) -> tuple[int, float] | None:
    """The run's last validation loss at or before `step` (metrics.jsonl), or None."""
    try:
        records = read_metrics(run_dir / "metrics.jsonl")
    except (OSError, DataError):
        return None
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None and r.get("step", 0) <= step]
    return val[-1] if val else None


def _source_names(cfg: RunConfig) -> list[str]:
    """Each data source's directory name and, where its meta.json lists them, what was prepared
    into it (e.g. default-corpus)."""
    names = []
    for source in cfg.data.sources:
        try:
            prepared = json.loads((Path(source) / "meta.json").read_text()).get("sources") or []
        except (OSError, ValueError):
            prepared = []
        names.append(f"`{Path(source).name}`" + (f" ({', '.join(map(str, prepared))})" if prepared else ""))
    if cfg.data.synthetic:
        return ["synthetic token ids"]
    return names or ["none recorded"]


# ---- import ------------------------------------------------------------------------------------


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class HfTensors:
    """The tensors of a Hugging Face directory (one file or an index), read one at a time from
    safetensors files only: a pickled weight file (pytorch_model.bin, …) can run code when it is
    loaded, so it is refused unopened, and so is an index naming anything but safetensors."""

    def __init__(self, hf_dir: Path):
        safe_open = require("safetensors", "import-hf (it reads safetensors)").safe_open
        index = hf_dir / INDEX
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(f"'{index}' is not a safetensors index ({type(e).__name__}: {e}).") from None
            others = [f for f in files if not str(f).endswith(".safetensors")]
            if others:
                raise ConfigError(
                    f"'{index}' lists {', '.join(map(str, others[:3]))}, which is not a safetensors file: "
                    f"import-hf reads only safetensors. {SAFETENSORS_ONLY}"
                )
        elif (hf_dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            pickles = sorted(p.name for p in hf_dir.iterdir() if p.is_file() and p.name.endswith(PICKLED_WEIGHTS))
            if pickles:
                raise ConfigError(
                    f"'{hf_dir}' holds its weights as {', '.join(pickles[:3])}: pickles, which can run code when "
                    f"they are loaded, and import-hf reads only safetensors. {SAFETENSORS_ONLY}"
                )
            raise ConfigError(
                f"'{hf_dir}' has no model.safetensors (or its index): pass a Hugging Face model directory."
            )
        self.dir, self.files = hf_dir, {}
        for f in files:
            if Path(f).is_absolute() or ".." in Path(f).parts or not (hf_dir / f).is_file():
                raise ConfigError(f"'{hf_dir}': the weight file '{f}' is missing (or outside the directory).")
            try:
                self.files[f] = safe_open(str(hf_dir / f), framework="pt")
            except Exception as e:  # noqa: BLE001 (safetensors raises its own error types)
                raise ConfigError(
                    f"'{hf_dir / f}' is not a readable safetensors file ({type(e).__name__}: {e}); nothing in it was "
                    "run. Re-download it, or convert the weights to safetensors."
                ) from None
        self.where = {name: f for f, handle in self.files.items() for name in handle.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def take(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor `name` in fp32 (only row `index` of it, when given)."""
        if name not in self.where:
            raise ConfigError(f"{self.dir}: tensor '{name}' is missing (is this the model its config.json describes?).")
        handle = self.files[self.where[name]]
        value = handle.get_tensor(name) if index is None else handle.get_slice(name)[index : index + 1][0]
        if not value.is_floating_point() or value.dtype.itemsize < 2:
            raise ConfigError(
                f"{self.dir}: tensor '{name}' is {str(value.dtype).removeprefix('torch.')}: quantized weights are not "
                "imported. Use the model's bf16, fp16 or fp32 release (or dequantize it first)."
            )
        value = value.to(torch.float32)
        if not torch.isfinite(value).all():
            raise ConfigError(f"{self.dir}: tensor '{name}' holds NaN or infinite values: the weights are damaged.")
        return value

    def layers(self) -> int:
        """How many decoder layers the tensors hold (model.layers.N.…: the largest N + 1)."""
        return max((int(m.group(1)) + 1 for m in map(_LAYER.match, self.where) if m), default=0)


@torch.no_grad()
def import_hf(hf_dir: str | Path, out_dir: str | Path) -> dict:
    """A Hugging Face directory (config.json + safetensors, one file or sharded, per-expert or fused
    expert tensors) → a moetrain run directory: config.yaml, tokenizer.json and a weights-only
    checkpoint `checkpoints/step-0` (for `generate`, `eval`, `export-hf`, `upcycle`, `train`)."""
    require("safetensors.torch", "import-hf (it reads safetensors)")  # before any work
    hf_dir, out = Path(hf_dir), Path(out_dir)
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"'{hf_dir}' has no config.json: pass a Hugging Face model directory.")
    try:
        hf = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"'{config_file}' is not a JSON file ({type(e).__name__}: {e}).") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"'{config_file}' holds a JSON {type(hf).__name__}, not the object of a model's config.")
    cfg = RunConfig(model=model_config_from_hf(hf, str(config_file)))
    setup = _training_setup(cfg, hf_dir, hf)
    params = count_params(cfg.model).total
    check_weights_destination(out, params, "the imported checkpoint")
    refuse_unless_it_fits(params, "cpu", "The imported checkpoint", "Run it on a machine with more memory.")
    tensors = HfTensors(hf_dir)
    nextn = hf.get("num_nextn_predict_layers") or 0  # GLM's prediction layers follow the decoder's
    if tensors.layers() > cfg.model.n_layers + nextn:
        raise ConfigError(
            f"{hf_dir}: the weights hold {tensors.layers()} layers, but config.json says num_hidden_layers="
            f"{cfg.model.n_layers}: it is not the config of these weights."
        )
    model = cfg.model.build(device="cpu")
    model.init_weights()  # buffers that are not in the HF files (RoPE tables; a softmax model's biases)
    state = model_state_dict(model)  # views of the model's tensors, experts split

    tied = bool(hf.get("tie_word_embeddings"))  # moetrain's head is untied: it starts as a copy of the embedding
    plan = [replace(t, name=EMBEDDING) if tied and t.entry == "lm_head.weight" else t for t in tensor_plan(cfg.model)]
    interleaved = cfg.model.is_mla and hf.get("rope_interleave", True)  # transformers' default
    for t in plan:
        if not t.entry:
            continue
        target = state[t.entry][t.rows[0] : t.rows[1]] if t.rows else state[t.entry]
        value = _hf_value(tensors, t, cfg.model.moe.expert_hidden)
        value = rope_rows_from_interleaved(cfg.model, t.name, value) if interleaved else value
        if tuple(value.shape) != tuple(target.shape):
            raise ConfigError(
                f"{hf_dir}: tensor '{t.name}' has shape {tuple(value.shape)}, but its config.json describes "
                f"{tuple(target.shape)}."
            )
        target.copy_(value)
    path = save_weights(out, cfg, model, hf_dir / "tokenizer.json", {"imported_from": str(hf_dir)})
    untokenized = NO_TOKENIZER.format(hf_dir) * (not (hf_dir / "tokenizer.json").is_file())
    for note in (setup["note"], UNTIED * tied, untokenized):
        if note:
            print(note, file=sys.stderr)
    return {
        "architecture": architecture_for(cfg.model).value,
        "checkpoint": str(path),
        "config": str(out / "config.yaml"),
        "tensors": len(plan),
        "parameters": sum(p.numel() for p in model.parameters()),
        "training_setup": {k: v for k, v in setup.items() if k != "note"},
    }


def _training_setup(cfg: RunConfig, hf_dir: Path, hf: dict) -> dict:
    """Set `cfg`'s training set-up for a model coming back: from the moetrain config an export
    wrote beside it (sequence length, document masking, batch sizes, validation tokens, optimizer,
    schedule, the MoE losses' weights and the aux-free bias rate: the run goes on as it trained),
    else the defaults, no longer than its config.json's max_position_embeddings.
    Returns where it came from, the values and, for assumed ones, the note to print."""
    trained, note = hf_dir / TRAINING_CONFIG, None
    if trained.is_file():
        run = RunConfig.from_dict(load_yaml(trained, RunConfig))
        cfg.data.seq_len, cfg.data.document_masking = run.data.seq_len, run.data.document_masking
        cfg.train.global_batch_size = run.train.global_batch_size
        cfg.train.micro_batch_size = run.train.micro_batch_size
        cfg.train.eval_tokens = run.train.eval_tokens
        cfg.optim, cfg.schedule = run.optim, run.schedule
        moe, trained_moe = cfg.model.moe, run.model.moe
        moe.lb_loss_weight, moe.z_loss_weight = trained_moe.lb_loss_weight, trained_moe.z_loss_weight
        moe.bias_update_rate = trained_moe.bias_update_rate
        source = str(trained)
    else:
        positions = hf.get("max_position_embeddings")
        bound = isinstance(positions, int) and positions > 0
        if bound and positions < cfg.data.seq_len:
            cfg.data.seq_len = positions  # no longer than the model was made for
        limit = f" (at most its config.json's max_position_embeddings={positions})" if bound else ""
        source = "assumed (moetrain's defaults: the directory has no moetrain_config.yaml)"
        note = (
            f"import-hf: {hf_dir} says nothing of how the model was trained; assumed data.seq_len="
            f"{cfg.data.seq_len}{limit}, train.global_batch_size={cfg.train.global_batch_size}, "
            f"train.micro_batch_size={cfg.train.micro_batch_size} and the default optimizer and schedule: set them "
            "with --data.seq_len=… --train.global_batch_size=… when you train."
        )
    return {
        "note": note,
        "from": source,
        "data.seq_len": cfg.data.seq_len,
        "train.global_batch_size": cfg.train.global_batch_size,
        "train.micro_batch_size": cfg.train.micro_batch_size,
    }


def _hf_value(tensors: HfTensors, t: HfTensor, hidden: int) -> torch.Tensor:
    """`t` from the directory: by its Hub name, or from transformers 5.x's fused expert tensors
    (gate_up_proj (E, 2F, D) with gate first, down_proj (E, D, F)), one expert at a time."""
    if t.name in tensors or ".mlp.experts." not in t.name:
        return tensors.take(t.name)
    prefix, expert, proj, _ = t.name.rsplit(".", 3)  # model.layers.{i}.mlp.experts, e, *_proj, weight
    if proj == "down_proj":
        return tensors.take(f"{prefix}.down_proj", int(expert))
    gate_up = tensors.take(f"{prefix}.gate_up_proj", int(expert))
    return gate_up[:hidden] if proj == "gate_proj" else gate_up[hidden:]
