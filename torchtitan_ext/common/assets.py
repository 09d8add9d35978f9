"""Assets for CPU runs without any download: a word-level tokenizer and a generated corpus.

The corpus is arithmetic written digit by digit ("3 4 plus 5 is 3 9 ."), drawn from a
seeded generator: small, learnable (the loss falls visibly within 20 steps) and identical
on every machine. The tokenizer covers exactly its words; regenerate the shipped files
with ``python -m torchtitan_ext.common.assets``.
"""

from __future__ import annotations

import json
import os
import random

TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "tokenizer")
DATASET_NAME = "rrfp_arithmetic"
SPECIAL_TOKENS = ("<unk>", "<bos>", "<eos>")
WORDS = tuple(str(d) for d in range(10)) + ("plus", "minus", "times", "is", ".")


def _number(n: int) -> str:
    return " ".join(str(n))


def arithmetic_corpus(samples: int = 4000, seed: int = 0) -> list[str]:
    """``samples`` documents, each a few equations over numbers below 100."""
    rng = random.Random(seed)
    documents = []
    for _ in range(samples):
        equations = []
        for _ in range(rng.randint(4, 10)):
            a, b = rng.randrange(100), rng.randrange(100)
            op, value = rng.choice((("plus", a + b), ("minus", a - b), ("times", a * b)))
            if value < 0:
                a, b, value = b, a, -value
            equations.append(f"{_number(a)} {op} {_number(b)} is {_number(value)} .")
        documents.append(" ".join(equations))
    return documents


def write_tokenizer(directory: str = TOKENIZER_DIR) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + WORDS)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}, f, indent=1)


def register_dataset() -> None:
    """Make ``training.dataset = "rrfp_arithmetic"`` load the generated corpus."""
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS[DATASET_NAME] = DatasetConfig(
        path="generated",
        loader=lambda path: Dataset.from_list([{"text": t} for t in arithmetic_corpus()]),
        sample_processor=lambda sample: sample["text"],
    )


if __name__ == "__main__":
    write_tokenizer()
    print(f"wrote {TOKENIZER_DIR}")
