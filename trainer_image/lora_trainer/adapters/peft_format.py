"""HF PEFT's on-disk LoRA format: read, validate and write one adapter directory.

The format is the contract with the rest of the ecosystem (transformers, vLLM, hubs):
`adapter_config.json` plus `adapter_model.safetensors` whose keys are
`base_model.model.<module>.lora_A.weight` ([r, in]) and `<module>.lora_B.weight` ([out, r]).

Why validate here, before any model is touched: an adapter made elsewhere may use PEFT
features that a plain LoRA cannot express (DoRA, trained biases, extra full modules,
per-module ranks). Importing those silently would give a model that runs and is wrong,
so every such feature is refused with a message that names it. rsLoRA is the exception:
its `alpha / sqrt(r)` scale is folded exactly into an equivalent `alpha` (scale = alpha / r),
which is what the JAX side (Qwix) applies.

Pure file I/O on a local directory (no JAX, no torch); callers stage gs:// through
`lora_trainer.storage`.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from lora_trainer import storage
from lora_trainer.errors import UserError, shown

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
#: PEFT prefixes every key with the wrapper path of `PeftModelForCausalLM`.
KEY_PREFIX = "base_model.model."
#: `LoraConfig.lora_alpha`'s default, which applies when a config omits it.
PEFT_DEFAULT_ALPHA = 8
_KEY_RE = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
#: safetensors' names of the (little-endian) floating dtypes an adapter may hold.
SAFETENSORS_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class LoraHyper:
    """The adapter-wide LoRA settings, normalised so that the update is `B @ A * alpha / rank`."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ()
    """HF short module names (e.g. `q_proj`), sorted; or one regex, which PEFT full-matches against module names."""
    base_model: str | None = None
    """`base_model_name_or_path`: where the base model lives (URI or hub id), if known."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class PeftLoraAdapter:
    """A LoRA adapter in PEFT's layout: HF module name -> (A [r, in], B [out, r])."""

    hyper: LoraHyper
    modules: Mapping[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    source: str | None = None
    """Where it was read from (a directory or URI), for errors about its tensors; None for one made here."""


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


#: The types of the keys `parse_config` reads whose type it does not check itself (null counts as absent).
_TYPES: dict[str, tuple[Any, str]] = {
    "peft_type": (lambda v: isinstance(v, str), "a string (LORA)"),
    "bias": (lambda v: isinstance(v, str), "a string (none)"),
    "target_modules": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(t, str) for t in v)),
                       "a list of module names or one regex (strings)"),
    "base_model_name_or_path": (lambda v: isinstance(v, str), "a string"),
    "use_dora": (_is_bool, "true or false"),
    "use_rslora": (_is_bool, "true or false"),
    "lora_bias": (_is_bool, "true or false"),
    "fan_in_fan_out": (_is_bool, "true or false"),
}


def _config_error(path: Path | str, what: str) -> UserError:
    return UserError(f"{path}: {what}")


def _nonempty(value: Any) -> bool:
    return value not in (None, False, "", [], {}, ())


def parse_config(raw: Mapping[str, Any], path: Path | str) -> LoraHyper:
    """Check an `adapter_config.json` for features a plain LoRA cannot express and normalise it.

    `path` is only used to name the file in errors.
    """
    _refuse_unsupported(raw, path)
    r, alpha, dropout = _hyperparameters(raw, path)
    targets = raw.get("target_modules") or ()
    if isinstance(targets, str):  # PEFT allows one regex; the tensors say which modules it matched.
        targets = ()
    base = raw.get("base_model_name_or_path")
    return LoraHyper(
        rank=r,
        alpha=alpha,
        dropout=float(dropout),
        target_modules=tuple(sorted(str(t) for t in targets)),
        base_model=str(base) if base else None,
    )


def _refuse_unsupported(raw: Mapping[str, Any], path: Path | str) -> None:
    """UserError for a key of the wrong type or a feature a plain LoRA cannot express (DoRA, biases, ...)."""
    for key, (test, what) in _TYPES.items():
        if raw.get(key) is not None and not test(raw[key]):
            raise _config_error(path, f"{key} is {shown(raw[key])}, expected {what}")
    peft_type = str(raw.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise _config_error(
            path,
            f"peft_type is {raw.get('peft_type')!r}; only LoRA adapters (peft_type LORA) can be converted. "
            "Other PEFT methods (IA3, AdaLoRA, LoHa, prefix tuning, ...) have no LoRA equivalent.",
        )
    if raw.get("use_dora"):
        raise _config_error(
            path,
            "use_dora is true: DoRA adapters carry a magnitude vector that a plain LoRA cannot express; "
            "retrain without DoRA or merge the adapter into the base model with PEFT first.",
        )
    if str(raw.get("bias", "none")) != "none" or raw.get("lora_bias"):
        raise _config_error(
            path,
            f"the adapter trains biases (bias={raw.get('bias')!r}, lora_bias={raw.get('lora_bias')!r}); "
            "only bias-free LoRA adapters (bias: none) are supported.",
        )
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        raise _config_error(
            path,
            f"init_lora_weights is {init!r}: PEFT changes the base weights whenever it loads such an adapter "
            "(PiSSA, OLoRA, CorDA and LoftQ subtract their initial adapter from the base), which an adapter for the "
            "unchanged base cannot reproduce; save it from PEFT as a plain LoRA adapter first "
            "(save_pretrained(..., path_initial_model_for_weight_conversion=...)), or merge it into the base.",
        )
    refused = {
        "modules_to_save": "fully trained extra modules",
        "rank_pattern": "per-module ranks",
        "alpha_pattern": "per-module alphas",
        "target_parameters": "LoRA on raw parameters (MoE experts)",
        "trainable_token_indices": "trained token embeddings",
        "layer_replication": "replicated layers",
        "use_qalora": "QA-LoRA pooling",
    }
    for key, meaning in refused.items():
        if _nonempty(raw.get(key)):
            raise _config_error(path, f"{key} is set ({meaning}): this is not a plain LoRA adapter and cannot be converted.")
    if raw.get("fan_in_fan_out"):
        raise _config_error(path, "fan_in_fan_out is true (Conv1D-style GPT-2 weights); these model families use Linear layers.")


def _hyperparameters(raw: Mapping[str, Any], path: Path | str) -> tuple[int, float, float]:
    """(r, alpha, dropout), checked; rsLoRA's alpha rescaled to the same scale under alpha / r."""
    r = raw.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _config_error(path, f"r must be a positive integer, got {shown(r)}")
    alpha = raw.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0 or not math.isfinite(alpha):
        raise _config_error(path, f"lora_alpha must be a positive number, got {shown(alpha)}")
    alpha = float(alpha)
    if raw.get("use_rslora"):
        # PEFT scales rsLoRA by alpha / sqrt(r); an alpha of alpha * sqrt(r) gives the same scale under alpha / r.
        alpha = alpha * math.sqrt(r)
    dropout = raw.get("lora_dropout", 0.0) or 0.0
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
        raise _config_error(path, f"lora_dropout must be a number in [0, 1), got {shown(dropout)}")
    return r, alpha, dropout


#: `init_lora_weights` values with which PEFT rewrites the base weights on load (not only A and B).
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")


def config_json(hyper: LoraHyper) -> dict[str, Any]:
    """The `adapter_config.json` PEFT itself would write for this adapter (plain LoRA, no rsLoRA).

    A base on the hub (`hf://ORG/NAME@REV`) is written as PEFT names one, `ORG/NAME` and its
    revision, so that `AutoPeftModelForCausalLM` and vLLM can resolve it.
    """
    base, revision = hyper.base_model, None
    if base and storage.is_hf(base):
        base, revision, _ = storage.split_hf(base)
    return {
        "alpha_pattern": {},
        "base_model_name_or_path": base,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": int(hyper.alpha) if float(hyper.alpha).is_integer() else hyper.alpha,
        "lora_bias": False,
        "lora_dropout": hyper.dropout,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": hyper.rank,
        "rank_pattern": {},
        "revision": revision,
        "target_modules": hyper.target_modules if isinstance(hyper.target_modules, str) else sorted(hyper.target_modules),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def _read_tensors(path: Path, name: str) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file, as read-only views of one memory map of it.

    Why not `safe_open(...).get_tensor`: it copies every tensor into fresh memory, a pass
    over the whole adapter that the conversion then copies once more into its own layout.
    `safe_open` still checks the file first (header, offsets, size), so a truncated or
    corrupt file is a UserError naming it (`name`: where it came from) before any view is made.
    """
    try:
        with safe_open(str(path), framework="np"):
            pass
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(
            f"{name} is not a readable safetensors file ({e}); it may be truncated or corrupt: copy it again"
        ) from e
    data = np.memmap(path, dtype=np.uint8, mode="r")
    (header_len,) = struct.unpack("<Q", data[:8].tobytes())
    header = json.loads(data[8 : 8 + header_len].tobytes())
    header.pop("__metadata__", None)
    start = 8 + header_len
    tensors: dict[str, np.ndarray] = {}
    for key, info in header.items():
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise UserError(f"{name}: tensor {key!r} has dtype {info['dtype']}, expected a floating-point dtype")
        begin, end = info["data_offsets"]
        tensors[key] = data[start + begin : start + end].view(SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def _unexpected_key(key: str) -> str:
    """Why a tensor is not one of a plain PEFT LoRA adapter's, and what to do about it."""
    lora = re.search(r"\.lora_[AB](\.[^.]+)?\.weight$", key)
    if lora and lora[1]:
        return (f"still carries the adapter name {lora[1][1:]!r} (as a model's state_dict does); save the adapter with "
                "PEFT's save_pretrained, which writes base_model.model.<module>.lora_A.weight")
    if lora and not key.startswith(KEY_PREFIX):
        return (f"lacks PEFT's {KEY_PREFIX!r} prefix; save the adapter with PEFT's save_pretrained, or prefix every "
                "key with it")
    return ("is not a LoRA weight (expected base_model.model.<module>.lora_A.weight or .lora_B.weight); embeddings "
            "LoRA, biases, DoRA magnitudes and saved full modules are not supported")


def group_modules(tensors: Mapping[str, np.ndarray], hyper: LoraHyper, path: Path | str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Pair `lora_A`/`lora_B` tensors per module and check names, ranks and values."""
    halves: dict[str, dict[str, np.ndarray]] = {}
    for key, arr in tensors.items():
        m = _KEY_RE.match(key)
        if m is None:
            raise UserError(f"{path}: tensor {key!r} {_unexpected_key(key)}")
        if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name != "bfloat16":
            raise UserError(f"{path}: tensor {key!r} has dtype {arr.dtype}, expected a floating-point dtype")
        if arr.ndim != 2:
            raise UserError(f"{path}: tensor {key!r} has shape {list(arr.shape)}, expected a 2-D matrix")
        r_axis = 0 if m["ab"] == "A" else 1
        if arr.shape[r_axis] != hyper.rank:
            raise UserError(
                f"{path}: tensor {key!r} has shape {list(arr.shape)} but adapter_config.json says r={hyper.rank} "
                f"(rank mismatch: lora_A is [r, in], lora_B is [out, r])"
            )
        if not np.isfinite(arr.astype(np.float32, copy=False)).all():
            raise UserError(f"{path}: tensor {key!r} holds NaN or Inf values; the adapter is broken (retrain or re-export it)")
        halves.setdefault(m["module"], {})[m["ab"]] = arr
    if not halves:
        raise UserError(f"{path} holds no LoRA tensors")
    modules: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module, ab in sorted(halves.items()):
        missing = {"A", "B"} - ab.keys()
        if missing:
            raise UserError(f"{path}: module {module!r} has no lora_{missing.pop()}.weight (each module needs lora_A and lora_B)")
        modules[module] = (ab["A"], ab["B"])
    return modules


def read_peft_adapter(directory: Path, source: str | None = None) -> PeftLoraAdapter:
    """Read and validate the PEFT adapter in a local directory; errors name its files under `source`
    (the URI it was downloaded from; default the directory)."""
    source = source or str(directory)
    config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    config_name, weights_name = storage.join(source, CONFIG_NAME), storage.join(source, WEIGHTS_NAME)
    if not config_path.is_file():
        raise UserError(
            f"{config_name} does not exist: an HF PEFT adapter directory holds {CONFIG_NAME} and {WEIGHTS_NAME}"
        )
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{config_name} is not valid UTF-8 JSON ({e})") from e
    except RecursionError as e:  # Python's parser recurses per nesting level
        raise UserError(f"{config_name} is nested too deeply to be an adapter config") from e
    if not isinstance(raw, dict):
        raise UserError(f"{config_name} holds a JSON {type(raw).__name__}, not the object an adapter config is")
    hyper = parse_config(raw, config_name)
    if not weights_path.is_file():
        hint = " (pickled adapter_model.bin files are not read: re-save with safe_serialization=True)" if (
            directory / "adapter_model.bin"
        ).exists() else ""
        raise UserError(f"{weights_name} does not exist{hint}")
    modules = group_modules(_read_tensors(weights_path, weights_name), hyper, weights_name)
    return PeftLoraAdapter(hyper=hyper, modules=modules, source=source)


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Write `tensors` (any memory layout) as one safetensors file, in key order.

    Why not `safetensors.numpy.save_file`: it first copies every tensor into a new `bytes`
    object (`tobytes`), and those 168 MB of fresh memory for an 8B adapter cost more than
    the write itself. Here a C-contiguous tensor is written straight from its buffer and
    any other (the transposed views the layout mapping makes) goes through one scratch
    buffer reused for every tensor. The format: an 8-byte little-endian header length, a
    JSON header `{key: {dtype, shape, data_offsets}, "__metadata__": {...}}` padded with
    spaces to a multiple of 8 bytes, then the tensors' bytes back to back.
    """
    keys = sorted(tensors)
    header: dict[str, Any] = {}
    offset = 0
    for key in keys:
        arr = tensors[key]
        dtype = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
        if dtype not in _SAFETENSORS_NAMES:
            raise ValueError(f"tensor {key!r} has dtype {arr.dtype}, which an adapter file cannot hold")
        header[key] = {"dtype": _SAFETENSORS_NAMES[dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    scratch = np.empty(max((t.nbytes for t in tensors.values()), default=0), np.uint8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for key in keys:
            f.write(_little_endian_c_order(tensors[key], scratch))


def _little_endian_c_order(arr: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """The bytes (uint8) of `arr` in C order, little-endian: its own buffer when it already is, else a copy in `scratch`."""
    if not arr.flags.c_contiguous or arr.dtype.byteorder == ">":
        out = scratch[: arr.nbytes].view(arr.dtype.newbyteorder("<")).reshape(arr.shape)
        np.copyto(out, arr)
        arr = out
    return arr.reshape(-1).view(np.uint8)


def write_peft_adapter(directory: Path, adapter: PeftLoraAdapter) -> None:
    """Write `adapter_config.json` and `adapter_model.safetensors` into an existing local directory."""
    tensors: dict[str, np.ndarray] = {}
    for module, (a, b) in sorted(adapter.modules.items()):
        tensors[f"{KEY_PREFIX}{module}.lora_A.weight"] = a  # any layout: written in C order
        tensors[f"{KEY_PREFIX}{module}.lora_B.weight"] = b
    write_safetensors(directory / WEIGHTS_NAME, tensors, {"format": "pt"})
    (directory / CONFIG_NAME).write_text(json.dumps(config_json(adapter.hyper), indent=2, sort_keys=True) + "\n")
