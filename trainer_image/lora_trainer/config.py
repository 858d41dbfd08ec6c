"""What a fine-tune is: the train config shared by the CRD, the operator and the trainer.

This module is the single source of truth for the training half of the API. The
operator's `LoraFinetune` spec embeds these models, the CRD schema in `crds/` is
generated from them, and `lora-trainer train --config FILE` parses the same models.
It imports nothing heavy (no JAX) so the operator image can use it.

Field names are camelCase on the wire (Kubernetes convention) and snake_case in
Python; every field's description is the documentation users see in `kubectl explain`
and in docs/reference.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from lora_trainer.errors import UserError
from lora_trainer.rules import Rule, enforce_rules

#: One path segment of a gs:// or hf:// URI: anything but `.`, `..` and the empty segment (`//`),
#: which a client resolves or collapses so that the object read or written is not the one named.
_SEGMENT = r"([^/\s.][^/\s]*|\.[^/\s.][^/\s]*|\.\.[^/\s]+)"
_GCS = rf"gs://[a-z0-9][-a-z0-9_.]{{1,61}}[a-z0-9](/{_SEGMENT})*/?"
_HF_ID = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_HF = rf"hf://{_HF_ID}/{_HF_ID}(@[A-Za-z0-9][-A-Za-z0-9_.]*)?(/{_SEGMENT})*/?"
#: Local paths: `file:///abs`, absolute, or relative with no `:` in the first segment (so `s3://x`
#: is no local path); spaces and colons allowed (a checkout under "My Projects" failed `make demo`),
#: control characters not. Where a local path is allowed at all is the operator's decision (its
#: `allowedLocalPaths` setting; run-local takes any).
_LOCAL = r"file:///[^\x00-\x1f\x7f]*|/[^\x00-\x1f\x7f]*|[^:/\x00-\x1f\x7f]+(/[^\x00-\x1f\x7f]*)?"
#: Inputs: `gs://BUCKET/PATH` (bucket 3-63 chars), `hf://ORG/NAME[@REVISION][/FILE]` or a local
#: path. RE2-compatible, since the API server evaluates the same pattern.
URI_PATTERN = rf"^({_GCS}|{_HF}|{_LOCAL})$"
#: Outputs: as inputs but without `hf://`, which is read-only.
OUTPUT_URI_PATTERN = rf"^({_GCS}|{_LOCAL})$"
#: Longest URI: a GCS object name is at most 1024 bytes, plus the bucket and the scheme.
MAX_URI = 1100
#: Longest name of a field in a dataset row, and of a `targetModules` regex.
MAX_FIELD_NAME, MAX_REGEX = 256, 1024
#: Upper bounds of the counts (steps, batch sizes, intervals): far above any real run, low enough
#: that no count overflows or makes the trainer allocate for ever.
MAX_STEPS, MAX_BATCH, MAX_DEVICES = 10_000_000, 65_536, 65_536

InputUri = Annotated[str, Field(pattern=URI_PATTERN, min_length=1, max_length=MAX_URI)]
OutputUri = Annotated[str, Field(pattern=OUTPUT_URI_PATTERN, min_length=1, max_length=MAX_URI)]
FieldName = Annotated[str, Field(min_length=1, max_length=MAX_FIELD_NAME)]
#: The powers of two a quantization tile may be, listed (CEL has no bitwise operators).
TILE_SIZES = [2**i for i in range(13)]


def family_names() -> tuple[str, ...]:
    """The model families: one folder each under `lora_trainer/models/families/` (see
    docs/dev/adding-a-family.md), read off the disk so that this module imports no model code."""
    root = Path(__file__).parent / "models" / "families"
    return tuple(sorted(d.name for d in root.iterdir() if (d / "__init__.py").is_file() and not d.name.startswith("_")))


Family = Literal[family_names()]  # type: ignore[valid-type]
DType = Literal["float32", "bfloat16", "float16"]
WeightQtype = Literal["nf4", "int4", "int8", "fp8"]
Schedule = Literal["cosine", "linear", "constant"]
Attention = Literal["auto", "splash", "xla"]
Remat = Literal["auto", "none", "dots", "full"]
DatasetFormat = Literal["text", "prompt-completion", "chat"]


class ApiModel(BaseModel):
    """Base for every API object: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )
    #: The model's cross-field rules (see `lora_trainer.rules`); a subclass adds to its bases' rules.
    __rules__: ClassVar[tuple[Rule, ...]] = ()

    @field_validator("*", mode="before")
    @classmethod
    def _as_the_schema_types_it(cls, value: Any, info: ValidationInfo) -> Any:
        """Integers and booleans as the CRD schema takes them: pydantic's lax mode would read
        `steps: true` as 1 and `rank: "4"` as 4, which `kubectl apply` refuses, so `lora-trainer`
        and `run-local` refuse them too. Numbers stay lax: YAML reads `2e-4` as a string."""
        annotation = cls.model_fields[info.field_name].annotation
        types = set(get_args(annotation)) or {annotation}
        if int in types and isinstance(value, bool | str):
            raise ValueError(f"expected an integer, got {value!r}")
        if bool in types and types <= {bool, type(None)} and value is not None and not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value

    @model_validator(mode="after")
    def _declared_rules_hold(self) -> Self:
        """Every model runs its declared rules here, the one validator for all of them; the CRD
        carries the same rules as CEL."""
        enforce_rules(self)
        return self

    def to_wire(self) -> dict[str, Any]:
        """The object as it appears in YAML/JSON: camelCase, defaults included, None dropped."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class ModelSpec(ApiModel):
    source: InputUri
    """Base model: an HF safetensors checkpoint directory (local path, `gs://bucket/dir` or `hf://org/name`)."""
    family: Family | None = None
    """Model family; detected from the checkpoint's `config.json` (`model_type`) when omitted."""
    dtype: DType = "bfloat16"
    """Dtype the base weights are loaded and computed in (matmuls accumulate in float32). LoRA parameters are always float32 (rounded to a 16-bit dtype where they meet activations, as torch.autocast does)."""


class DatasetSpec(ApiModel):
    train: InputUri
    """Training data: a JSONL (`.jsonl`) or Parquet (`.parquet`) file, local or `gs://`."""
    eval: InputUri | None = None
    """Optional evaluation data in the same format as `train`: evaluated every `training.evalEvery` steps and at the end."""
    format: DatasetFormat = "prompt-completion"
    """`text` (loss on every token), `prompt-completion` (loss on the completion) or `chat` (loss on assistant turns)."""
    text_field: FieldName = "text"
    """Field holding the text for format `text`."""
    prompt_field: FieldName = "prompt"
    """Field holding the prompt for format `prompt-completion`."""
    completion_field: FieldName = "completion"
    """Field holding the completion for format `prompt-completion`."""
    messages_field: FieldName = "messages"
    """Field holding the list of `{role, content}` messages for format `chat`."""
    max_seq_len: Annotated[int, Field(ge=8, le=131072)] = 1024
    """Examples are truncated to this many tokens (the count of truncated examples is logged)."""
    packing: bool = False
    """Pack several short examples into one sequence of up to maxSeqLen tokens instead of padding each; `training.globalBatchSize` then counts packed sequences."""


class QuantizationSpec(ApiModel):
    weight_qtype: WeightQtype
    """Quantize the frozen base weights of the LoRA-targeted layers (QLoRA): nf4, int4, int8 or fp8."""
    tile_size: Annotated[int, Field(ge=1, le=4096)] | None = None
    """Quantization tile along the contracting axis; a power of two that divides it for every targeted weight: the input dimension, or head_dim for the attention output projection (it contracts over heads x head_dim)."""

    __rules__ = (
        Rule("tileSize", f"!has(self.tileSize) || self.tileSize in {TILE_SIZES}",
             lambda q: q.tile_size is None or q.tile_size in TILE_SIZES,
             "tileSize must be a power of two (e.g. 32, 64, 128)"),
    )


class LoraSpec(ApiModel):
    rank: Annotated[int, Field(ge=1, le=1024)] = 16
    """LoRA rank r: the inner dimension of the low-rank update."""
    alpha: Annotated[float, Field(gt=0, le=1e6)] = 32.0
    """LoRA alpha: the update is scaled by alpha / rank, as in HF PEFT."""
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    """Dropout on the LoRA input during training."""
    target_modules: Annotated[str, Field(min_length=1, max_length=MAX_REGEX)] = "auto"
    """`auto` (the model family's default: all attention and MLP projections) or a regex full-matched against module paths: `layers/0/attn/{q,k,v,o}_proj` and `layers/0/mlp/{gate,up,down}_proj` (Llama, Qwen), or `layers/0/attn/q_einsum`, `attn/kv_einsum/{k,v}_proj`, `attn/attn_vec_einsum` and the same MLP names (Gemma 3). The trainer logs the modules it adapts."""
    quantization: QuantizationSpec | None = None
    """QLoRA: quantize the targeted base weights."""
    restore_from: InputUri | None = None
    """Start from an existing adapter: an Orbax LoRA checkpoint directory or an HF PEFT adapter directory."""

    # The bound (ge=1) refuses 0 first in pydantic; the API server reports the rule's hint as well.
    __rules__ = (Rule("rank", "self.rank > 0", lambda lora: lora.rank > 0, "rank must be > 0 (e.g. 8 or 16)"),)

    @field_validator("target_modules")
    @classmethod
    def _valid_regex(cls, v: str) -> str:
        if v != "auto":
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"targetModules is not a valid regex ({e}); use `auto` or e.g. `.*/attn/.*` (every attention projection)") from e
        return v


class MeshSpec(ApiModel):
    fsdp: Annotated[int, Field(ge=1, le=MAX_DEVICES)] | None = None
    """Devices along the fsdp axis; default: all devices not used by `tp`."""
    tp: Annotated[int, Field(ge=1, le=MAX_DEVICES)] = 1
    """Devices along the tensor-parallel axis."""


class CompilationCacheSpec(ApiModel):
    enabled: bool = True
    """Keep compiled programs across restarts, so a run resumed after a preemption does not compile its train step again (minutes for a large model)."""
    uri: OutputUri | None = None
    """Where the programs are kept (local path or `gs://`); default `<output.uri>/compilation-cache`. Share one location between runs of the same model and shapes to skip compiling on their first start too."""


class TrainingSpec(ApiModel):
    steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] = 1000
    """Optimizer steps to train."""
    global_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH)] = 8
    """Sequences per optimizer step, across all hosts (examples, or packed sequences with `dataset.packing`); must be divisible by gradientAccumulation. The step's loss is the mean over all its loss tokens."""
    gradient_accumulation: Annotated[int, Field(ge=1, le=MAX_BATCH)] = 1
    """Micro-batches per optimizer step (less memory): the same training as one batch, every loss token weighted alike."""
    learning_rate: Annotated[float, Field(gt=0, le=10)] = 2e-4
    """Peak learning rate of AdamW."""
    warmup_steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] = 0
    """Linear warmup from 0 to learningRate."""
    schedule: Schedule = "cosine"
    """Decay after warmup: cosine, linear (both to 0 at `steps`) or constant."""
    weight_decay: Annotated[float, Field(ge=0, le=10)] = 0.0
    """AdamW weight decay on the LoRA parameters."""
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0
    """Seed for LoRA initialisation, dropout and data shuffling."""
    eval_every: Annotated[int, Field(ge=1, le=MAX_STEPS)] | None = None
    """Evaluate on `dataset.eval` every N steps (requires dataset.eval); without it, only at the end."""
    checkpoint_every: Annotated[int, Field(ge=1, le=MAX_STEPS)] = 100
    """Save an Orbax checkpoint every N steps (and at the end, and on SIGTERM)."""
    checkpoints_to_keep: Annotated[int, Field(ge=1, le=1000)] = 3
    """Most recent checkpoints kept under output.uri/checkpoints."""
    log_every: Annotated[int, Field(ge=1, le=MAX_STEPS)] = 1
    """Report step, loss, tokens/s and ETA every N steps."""
    mesh: MeshSpec = Field(default_factory=MeshSpec)
    """Device mesh; (data, fsdp, tp) with data = devices / (fsdp * tp)."""
    remat: Remat = "auto"
    """What the backward pass recomputes instead of keeping from the forward pass, per decoder layer: `none` keeps every activation (fastest, most memory), `dots` keeps only the matmul outputs and recomputes the cheap elementwise work (norms, activations, rope): nearly as fast as `none` and, in a transformer layer, nearly as much memory, `full` keeps only each layer's input and recomputes the layer (least memory, about a third more compute). `auto`: `full` on TPU (it lets micro-batches of several 2048-4096-token rows fit; set `dots` where its memory fits, usually at a smaller micro-batch: 25-30% faster on a whole 1B or 3B model on a v5e chip), `none` on CPU (where memory is rarely what limits a run)."""
    scan_layers: bool = False
    """Compile one decoder layer and run it for every layer with `lax.scan`: compile time stops growing with depth (on a v5e chip: 1B 151 -> 66 s, 3B 212 -> 91 s, and an 8B QLoRA compiles in 127 s, which unrolled does not within 10 minutes), at a cost in step time (1B 6%, 3B 20% under `remat: dots`) and memory (1.0-1.8 GiB); so off by default, on for large models and QLoRA. The layers' frozen weights are stacked in place (one copy). It needs layers that are one program: Llama 3 and Qwen with `lora.dropout: 0` and the same `targetModules` on every layer (not Gemma 3, whose layers alternate sliding-window and global attention); where they are not, the run stops with an error naming why. The result is the same either way."""
    attention: Attention = "auto"
    """Attention kernel: `splash` (the Pallas splash-attention kernel, TPU only; sequence length a multiple of 128), `xla` (portable; CPU and GPU), or `auto` (splash on TPU where it applies, else xla). The result is the same function either way."""
    compilation_cache: CompilationCacheSpec = Field(default_factory=CompilationCacheSpec)
    """Persistent JAX compilation cache."""

    __rules__ = (
        Rule("globalBatchSize", "self.globalBatchSize % self.gradientAccumulation == 0",
             lambda t: t.global_batch_size % t.gradient_accumulation == 0,
             "globalBatchSize must be divisible by gradientAccumulation"),
    )


class ExportSpec(ApiModel):
    hf_peft: bool = True
    """After training, export an HF PEFT adapter (adapter_config.json + adapter_model.safetensors) to output.uri/hf-adapter."""
    merged: bool = False
    """Also export the base model with the adapter merged to output.uri/merged."""


class OutputSpec(ApiModel):
    uri: OutputUri
    """Where checkpoints (uri/checkpoints/<step>), metrics and the exported adapter (uri/hf-adapter) go."""
    export: ExportSpec = Field(default_factory=ExportSpec)
    """What the post-training export produces."""

    # The URI's pattern refuses hf:// first in pydantic; the API server reports the rule's reason as well.
    __rules__ = (
        Rule("uri", "!self.uri.startsWith('hf://')", lambda out: not out.uri.startswith("hf://"),
             "uri: hf:// is read-only; write to gs://BUCKET/... or a path"),
    )


class TrainConfig(ApiModel):
    """Everything `lora-trainer train` needs; the training half of a LoraFinetune spec."""

    model: ModelSpec
    """The base model."""
    dataset: DatasetSpec
    """Training (and evaluation) data."""
    lora: LoraSpec = Field(default_factory=LoraSpec)
    """LoRA / QLoRA adapter settings."""
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    """Optimisation, checkpointing and mesh."""
    output: OutputSpec
    """Where results go."""

    __rules__ = (
        Rule("training.evalEvery", "!(has(self.training) && has(self.training.evalEvery)) || has(self.dataset.eval)",
             lambda c: c.training.eval_every is None or c.dataset.eval is not None,
             "training.evalEvery is set but dataset.eval is empty: add dataset.eval or drop evalEvery"),
    )


def field_names() -> list[str]:
    """Every wire (camelCase) field name of the API models, the CR's included: what a misspelt
    field is matched against."""
    names: set[str] = set()
    todo: list[type[BaseModel]] = [ApiModel]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        names.update(f.alias or name for name, f in cls.model_fields.items())
    return sorted(names)


def did_you_mean(name: str, candidates: list[str]) -> str:
    """`; did you mean 'x'?` for the closest candidate (case-insensitive), or nothing."""
    lowered = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.7)
    return f"; did you mean {lowered[close[0]]!r}?" if close else ""


def _problem(err: Any) -> str:
    """Pydantic's message, said as the fix where it can be: a URI pattern mismatch in words instead
    of a regex, a misspelt field with the closest real name, a list where one regex belongs."""
    pattern = err.get("ctx", {}).get("pattern")
    if err["type"] == "string_pattern_mismatch" and pattern in (URI_PATTERN, OUTPUT_URI_PATTERN):
        allowed = "a local path, gs://BUCKET/PATH or file:///PATH" + (" or hf://ORG/NAME" if pattern == URI_PATTERN else "")
        return (f"{err['input']!r} is not a supported location; use {allowed}, with no '.' or '..' segment and no '//' "
                "inside a gs:// or hf:// path")
    if err["type"] == "extra_forbidden" and err["loc"]:
        return f"unknown field{did_you_mean(str(err['loc'][-1]), field_names()) or '; remove it or fix its spelling'}"
    names = err["input"] if err["type"] == "string_type" and isinstance(err["input"], list) else None
    if names and err["loc"][-1:] == ("targetModules",) and all(isinstance(n, str) for n in names):
        return f"one regex, not a list: write {'.*(' + '|'.join(names) + ')'!r}"
    return str(err["msg"])


def validation_problems(e: ValidationError, prefix: str = "") -> str:
    """Every error of a pydantic validation as `field.path: message`, joined by '; '.

    Shared by the operator (CR specs, settings), local mode and the trainer's `--config`, so a
    bad field reads the same wherever it is caught.
    """
    return "; ".join(f"{(prefix + '.'.join(str(x) for x in err['loc'])).rstrip('.') or 'top level'}: {_problem(err)}" for err in e.errors())


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML syntax error on one line, `at line L, column C: problem` (PyYAML's own text spans several)."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{where}: {getattr(e, 'problem', None) or e}"


def load_train_config(path: str | Path) -> TrainConfig:
    """Parse a train config file (YAML or JSON; JSON is YAML); UserError naming the file and every bad field."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"--config {path}: not UTF-8 text (byte {e.start + 1}); save the train config as UTF-8") from e
    except OSError as e:
        raise UserError(f"--config {path}: cannot read the train config ({e.strerror}); pass the file the operator rendered") from e
    except yaml.YAMLError as e:
        raise UserError(f"--config {path}: not valid YAML or JSON{yaml_problem(e)}; fix the syntax") from e
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(f"--config {path}: invalid train config: {validation_problems(e)}") from e


def dump_train_config(cfg: TrainConfig) -> str:
    """The config as the operator ships it in a ConfigMap: stable, sorted JSON."""
    return json.dumps(cfg.to_wire(), indent=2, sort_keys=True) + "\n"
