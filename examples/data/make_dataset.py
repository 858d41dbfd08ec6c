"""Write the demo's instruction dataset: examples/data/{train,eval}.jsonl (prompt-completion).

Written for this project, generated deterministically (fixed seed, fixed tables), and the
output is committed, so `make demo` needs no download. Five small tasks whose answers follow a
fixed template from a closed vocabulary: a model can learn them, so the training loss of the
tiny demo model falls visibly within a few hundred steps on a laptop CPU.

    python examples/data/make_dataset.py          # rewrite the two files
    python examples/data/make_dataset.py --check  # exit 1 if the committed files differ
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 2026
TRAIN_SIZE = 400
EVAL_SIZE = 40

CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Canada": "Ottawa", "Peru": "Lima",
    "Norway": "Oslo", "Egypt": "Cairo", "Chile": "Santiago", "Spain": "Madrid", "India": "New Delhi",
    "Italy": "Rome", "Ghana": "Accra", "Cuba": "Havana", "Nepal": "Kathmandu", "Poland": "Warsaw",
}
COLOURS = {
    "banana": "yellow", "lime": "green", "tomato": "red", "plum": "purple", "carrot": "orange",
    "snow": "white", "coal": "black", "sky": "blue", "grass": "green", "cherry": "red",
}
POSITIVE = ["great", "fast", "friendly", "clean", "reliable", "helpful", "quiet", "fresh"]
NEGATIVE = ["slow", "broken", "rude", "dirty", "noisy", "late", "stale", "confusing"]
THINGS = ["service", "hotel", "train", "laptop", "cafe", "app", "support team", "delivery"]
WORDS = ["tpu", "slice", "adapter", "queue", "model", "token", "pod", "bucket", "node", "batch"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]

Example = dict[str, str]


def capital(rng: random.Random) -> Example:
    country = rng.choice(sorted(CAPITALS))
    return {"prompt": f"What is the capital of {country}?\n", "completion": f"The capital of {country} is {CAPITALS[country]}."}


def colour(rng: random.Random) -> Example:
    thing = rng.choice(sorted(COLOURS))
    return {"prompt": f"What colour is {thing}?\n", "completion": f"{thing.capitalize()} is {COLOURS[thing]}."}


def review(rng: random.Random) -> Example:
    positive = rng.random() < 0.5
    words = rng.sample(POSITIVE if positive else NEGATIVE, 2)
    thing = rng.choice(THINGS)
    return {
        "prompt": f"Label the review: The {thing} was {words[0]} and {words[1]}.\n",
        "completion": f"Label: {'positive' if positive else 'negative'}",
    }


def add(rng: random.Random) -> Example:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return {"prompt": f"Add {NUMBER_WORDS[a]} and {NUMBER_WORDS[b]}.\n", "completion": f"{NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]}."}


def shout(rng: random.Random) -> Example:
    words = rng.sample(WORDS, 3)
    return {"prompt": f"Shout: {' '.join(words)}\n", "completion": f"{' '.join(words).upper()}!"}


TASKS: tuple[Callable[[random.Random], Example], ...] = (capital, colour, review, add, shout)


def examples(rng: random.Random, n: int) -> Iterator[Example]:
    """`n` examples cycling through the tasks in a shuffled order."""
    for i in range(n):
        yield TASKS[(i + rng.randrange(len(TASKS))) % len(TASKS)](rng)


def render() -> dict[str, str]:
    """File name -> JSONL text; the same bytes on every run."""
    rng = random.Random(SEED)
    train = list(examples(rng, TRAIN_SIZE))
    evaluation = list(examples(rng, EVAL_SIZE))
    return {name: "".join(json.dumps(x, sort_keys=True) + "\n" for x in rows) for name, rows in (("train.jsonl", train), ("eval.jsonl", evaluation))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE, help="directory to write into (default: examples/data)")
    p.add_argument("--check", action="store_true", help="exit 1 if the files on disk differ")
    args = p.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python examples/data/make_dataset.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
