#!/usr/bin/env python3
"""Writes text files as a Megatron-Core indexed dataset (<prefix>.bin / <prefix>.idx), byte-level:
every file is one document, every byte one token (vocabulary 256, stored as uint8), written by
megatron-core's own IndexedDatasetBuilder, as preprocess_data.py would with a byte tokenizer.
gpt_pretrain reads the result with --data-prefix PREFIX --vocab-size 256.

Setup: python3 -m pip install --no-deps megatron-core==0.16.1; python3 -m pip install
numpy==2.2.6 packaging==26.4 (torch installed).

  python3 tools/text_to_indexed.py PREFIX FILE... (or a folder: its *.py files, sorted)
"""

import pathlib
import sys

import numpy
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    prefix, inputs = sys.argv[1], [pathlib.Path(a) for a in sys.argv[2:]]
    files = []
    for path in inputs:
        # A folder: its *.py files, sorted, without installed packages (site-packages).
        files += sorted(f for f in path.rglob("*.py") if "site-packages" not in f.parts) if path.is_dir() else [path]
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint8)
    documents = tokens = 0
    for path in files:
        data = path.read_bytes()
        if len(data) < 2:
            continue
        builder.add_item(torch.from_numpy(numpy.frombuffer(data, dtype=numpy.uint8).astype(numpy.int64)))
        builder.end_document()
        documents += 1
        tokens += len(data)
    builder.finalize(prefix + ".idx")
    print(f"text_to_indexed: {documents} documents, {tokens} tokens -> {prefix}.bin / .idx")


if __name__ == "__main__":
    main()
