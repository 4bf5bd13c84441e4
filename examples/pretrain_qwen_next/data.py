"""Training data that needs no download: the Python standard library's own sources, byte-tokenized and
packed into rows with document boundaries.

Tokenizer: one token per UTF-8 byte (0..255) plus BOS (256) and EOS (257); VOCAB_SIZE = 258.
Documents: every *.py file under the running interpreter's stdlib (about 1,000 files, ~40 MB),
or your own data: `.jsonl` (one JSON object per line, its "text" field is a document), `.txt`
(one document per file), or a folder of such files.

Packing: documents, each as BOS + bytes + EOS, are concatenated in a fixed shuffled order and cut into
rows of `seq_len` tokens (a document may continue into the next row; it restarts its positions there).
Each row comes with position_ids that restart at every document start (how HF and flashqla see
document boundaries, i.e. cu_seqlens) and labels shifted within each document (-100 on the last token
of each document piece, so no token predicts across a boundary).
"""
from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import torch

BOS, EOS = 256, 257
VOCAB_SIZE = 258
IGNORE_INDEX = -100


def encode(text: str) -> list[int]:
    return [BOS, *text.encode("utf-8"), EOS]


def decode(tokens) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def stdlib_documents() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def user_documents(path: str) -> list[str]:
    """Documents from a .jsonl / .txt file or a folder of them."""
    root = Path(path)
    files = sorted(root.rglob("*")) if root.is_dir() else [root]
    docs = []
    for f in files:
        if f.suffix == ".jsonl":
            with f.open(encoding="utf-8") as lines:
                docs += [json.loads(line)["text"] for line in lines if line.strip()]
        elif f.suffix == ".txt":
            docs.append(f.read_text(encoding="utf-8", errors="replace"))
    if not docs:
        raise ValueError(f"data: no .jsonl or .txt documents found at {path}")
    return docs


class PackedRows:
    """Rows of `seq_len` tokens over the documents: row(i) -> (input_ids, position_ids, labels), each [1, seq_len]."""

    def __init__(self, documents: list[str], seq_len: int, seed: int = 0):
        order = list(range(len(documents)))
        random.Random(seed).shuffle(order)
        tokens, starts = [], []
        for i in order:
            starts.append(len(tokens))
            tokens += encode(documents[i])
        self.tokens = torch.tensor(tokens, dtype=torch.long)
        self.doc_start = torch.zeros(len(tokens), dtype=torch.bool)
        self.doc_start[starts] = True
        self.seq_len = seq_len
        if len(self) == 0:
            raise ValueError(f"data: {len(tokens)} tokens do not fill one row of {seq_len}")

    def __len__(self):
        return len(self.tokens) // self.seq_len

    def row(self, index: int):
        window = slice((index % len(self)) * self.seq_len, (index % len(self) + 1) * self.seq_len)
        ids, starts = self.tokens[window], self.doc_start[window].clone()
        starts[0] = True  # a document cut at the row start restarts here
        doc_index = starts.cumsum(0) - 1
        first = torch.nonzero(starts).reshape(-1)
        position_ids = torch.arange(self.seq_len) - first[doc_index]
        labels = torch.full_like(ids, IGNORE_INDEX)
        same_doc = ~starts[1:]  # token t + 1 continues token t's document
        labels[:-1][same_doc] = ids[1:][same_doc]
        return ids[None], position_ids[None], labels[None]


def load_rows(seq_len: int, data: str | None = None, seed: int = 0) -> PackedRows:
    return PackedRows(user_documents(data) if data else stdlib_documents(), seq_len, seed)
