"""Write the demo's base model: a tiny random Llama-3-shaped HF checkpoint, built offline.

Same files `save_pretrained` writes for Llama 3.1 (config.json with rope_scaling of type llama3,
model.safetensors, a byte-level BPE tokenizer with a chat template), only small enough to
fine-tune on a laptop CPU in a couple of minutes. Nothing is downloaded.

    python examples/make_tiny_model.py --out examples/tiny-llama
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lora_trainer.tiny_models import make_tiny_hf_model

#: Bigger than the unit-test models (2 layers, hidden 64, vocab 272) so the demo's loss curve
#: has room to fall, small enough that one optimizer step takes milliseconds on a CPU.
DEMO_SHAPE = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "tiny-llama", help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = p.parse_args(argv)
    out = make_tiny_hf_model("llama3", args.out, seed=args.seed, **DEMO_SHAPE)
    print(f"wrote a tiny Llama-3-shaped model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
