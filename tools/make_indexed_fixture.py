#!/usr/bin/env python3
"""Writes tests/data/megatron_indexed/: Megatron-Core indexed datasets and what GPTDataset draws.

The .bin/.idx pairs are written by megatron-core's own IndexedDatasetBuilder, and every expected
value in expected.json (header fields, each sequence's tokens, the document, sample and shuffle
indices, and the tokens/labels of the first samples of the train and validation splits, for two
single datasets, and a weighted and an unweighted blend of both) is read back through megatron-core's IndexedDataset,
GPTDataset and BlendedDataset, built by BlendedMegatronDatasetBuilder as pretrain_gpt.py builds
them. tests/indexed_dataset_test.cc checks amp8's C++ reader (recipes/data/) against it. The
output is deterministic: rerunning rewrites the same bytes.

Setup (CPU only; torch must already be installed, this does not touch it):
  python3 -m pip install --no-deps megatron-core==0.16.1
  python3 -m pip install numpy==2.2.6 packaging==26.4
The megatron-core 0.16.1 wheel ships its helpers_cpp extension prebuilt, so no compiler or
pybind11 is needed for build_sample_idx / build_blending_indices. The blend needs a one-process
gloo group (BlendedDataset asks torch.distributed for its rank), which the script makes itself.

Usage, from the repository root:
  python3 tools/make_indexed_fixture.py [output_folder]   (default tests/data/megatron_indexed)
"""

import json
import os
import sys
import tempfile
from importlib import metadata

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.utils import Split

MEGATRON_CORE_VERSION = "0.16.1"
SAMPLES_PER_SPLIT = 12


class FixtureTokenizer:
    """The tokenizer attributes GPTDatasetConfig and GPTDataset read; no text is tokenized."""

    def __init__(self, vocab_size, eod):
        self.vocab_size = vocab_size
        self.eod = eod
        self.unique_identifiers = {"class": "FixtureTokenizer", "vocab_size": vocab_size}


def make_documents(rng, num_documents, max_sequence_length, vocab_size, token_dtype):
    """Documents of one to three sequences (sentence-split style) of varied lengths.

    The token ids cover the whole vocabulary: the first sequence holds 0 and vocab_size - 1, so a
    reader that sign-extends uint16 or truncates int32 gets them wrong."""
    documents = []
    for document in range(num_documents):
        num_sequences = 1 if document % 5 else 1 + document % 3
        sequences = []
        for _ in range(num_sequences):
            length = int(rng.integers(1, max_sequence_length + 1))
            sequences.append(rng.integers(0, vocab_size, size=length, dtype=numpy.int64))
        documents.append(sequences)
    documents[0][0][:2] = [0, vocab_size - 1]
    documents[1][0][:1] = [1]  # a one-token sequence starts the second document
    documents[1][0] = documents[1][0][:1]
    return [[sequence.astype(token_dtype) for sequence in document] for document in documents]


def write_indexed_dataset(prefix, documents, token_dtype):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=token_dtype)
    for document in documents:
        for sequence in document:
            builder.add_item(torch.from_numpy(sequence.astype(numpy.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def describe_split(dataset, num_samples):
    """The indices GPTDataset built for one split, and the tokens/labels of its first samples."""
    samples = []
    for index in range(min(num_samples, len(dataset))):
        item = dataset[index]
        text, _ = dataset._query_document_sample_shuffle_indices(index)
        assert torch.equal(item["tokens"], torch.from_numpy(text[:-1]))
        assert torch.equal(item["labels"], torch.from_numpy(text[1:]))
        samples.append({"tokens": item["tokens"].tolist(), "labels": item["labels"].tolist()})
    return {
        "num_samples_requested": dataset.num_samples,
        "sequence_range": [int(dataset.indices[0]), int(dataset.indices[-1]) + 1],
        "length": len(dataset),
        "document_index": numpy.asarray(dataset.document_index).tolist(),
        "sample_index": numpy.asarray(dataset.sample_index).tolist(),
        "shuffle_index": numpy.asarray(dataset.shuffle_index).tolist(),
        "samples": samples,
    }


def describe_dataset(folder, name, token_dtype, vocab_size, gpt_config, sizes, cache_folder):
    prefix = os.path.join(folder, name)
    rng = numpy.random.default_rng(gpt_config["data_seed"])
    documents = make_documents(rng, gpt_config["num_documents"], 90, vocab_size, token_dtype)
    write_indexed_dataset(prefix, documents, token_dtype)

    indexed = IndexedDataset(prefix)
    description = {
        "prefix": name,
        "dtype": numpy.dtype(indexed.index.dtype).name,
        "dtype_code": DType.code_from_dtype(indexed.index.dtype),
        "sequence_count": len(indexed),
        "document_count": int(indexed.document_indices.shape[0]),
        "sequence_lengths": indexed.sequence_lengths.tolist(),
        "sequence_pointers": indexed.index.sequence_pointers.tolist(),
        "document_indices": indexed.document_indices.tolist(),
        "sequences": [indexed.get(i).astype(numpy.int64).tolist() for i in range(len(indexed))],
    }
    expected_sequences = [sequence.tolist() for document in documents for sequence in document]
    assert description["sequences"] == expected_sequences

    config = GPTDatasetConfig(
        random_seed=gpt_config["random_seed"],
        sequence_length=gpt_config["sequence_length"],
        blend=([prefix], None),
        split=gpt_config["split"],
        path_to_cache=os.path.join(cache_folder, name),
        tokenizer=FixtureTokenizer(vocab_size, eod=0),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mmap_bin_files=True,
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, sizes, lambda: True, config
    ).build()
    description["gpt"] = {
        "sequence_length": config.sequence_length,
        "random_seed": config.random_seed,
        "split": config.split,
        "add_extra_token_to_sequence": config.add_extra_token_to_sequence,
        "drop_last_partial_validation_sequence": config.drop_last_partial_validation_sequence,
        "splits": {
            "train": describe_split(train, SAMPLES_PER_SPLIT),
            "valid": describe_split(valid, SAMPLES_PER_SPLIT),
        },
    }
    return description


def describe_blend(folder, prefixes, weights, gpt_config, sizes, cache_folder):
    """A blend as BlendedMegatronDatasetBuilder builds it. Weighted ("0.3 gpt_uint16 0.7
    gpt_int32"): one GPTDataset per prefix and split with a 0.5% sample surplus, blended by
    build_blending_indices. Unweighted (weights None, "gpt_uint16 gpt_int32"): one epoch of each
    prefix's split, blended in proportion to their lengths, the size capped at their sum.
    BlendedDataset asks torch.distributed for its rank when it caches its indices, so a
    one-process gloo group stands in for the training job."""
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            "gloo", init_method="file://" + os.path.join(cache_folder, "rendezvous"), rank=0,
            world_size=1,
        )
    config = GPTDatasetConfig(
        random_seed=gpt_config["random_seed"],
        sequence_length=gpt_config["sequence_length"],
        blend=([os.path.join(folder, prefix) for prefix in prefixes], weights),
        split=gpt_config["split"],
        path_to_cache=os.path.join(cache_folder, "blend" if weights else "unweighted_blend"),
        tokenizer=FixtureTokenizer(262144, eod=0),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mmap_bin_files=True,
    )
    blended = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    splits = {}
    for split in (Split.train, Split.valid):
        dataset = blended[split.value]
        samples = []
        for index in range(min(SAMPLES_PER_SPLIT, len(dataset))):
            item = dataset[index]
            samples.append({"tokens": item["tokens"].tolist(), "labels": item["labels"].tolist()})
        splits[split.name] = {
            "size": sizes[split.value],
            "length": len(dataset),
            "mid_level_lengths": [len(mid_level) for mid_level in dataset.datasets],
            "dataset_index": dataset.dataset_index.tolist(),
            "dataset_sample_index": dataset.dataset_sample_index.tolist(),
            "samples": samples,
        }
    return {
        "prefixes": prefixes,
        "weights": weights,
        "sequence_length": config.sequence_length,
        "random_seed": config.random_seed,
        "split": config.split,
        "mid_level_dataset_surplus": config.mid_level_dataset_surplus,
        "splits": splits,
    }


def describe_split_ranges():
    """Sequence ranges per split, computed as BlendedMegatronDatasetBuilder computes them; the
    cases include halves (2.5, 4.5), which Python rounds to even."""
    cases = [("969,30,1", 1000), ("969, 30, 1", 72), ("1,1,2", 10), ("99,1", 72), ("1", 5),
             ("3,0,1", 10), ("0.5 0.25 0.25", 6), ("80,15,5", 72), ("70,20,10", 29)]
    ranges = []
    for split, num_sequences in cases:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        ranges.append({
            "split": split,
            "num_sequences": num_sequences,
            "ranges": [
                None if bookends is None else [int(round(bookends[0] * float(num_sequences))),
                                               int(round(bookends[1] * float(num_sequences)))]
                for bookends in matrix
            ],
        })
    return ranges


def describe_random_state():
    """numpy RandomState draws past 32 bits (the 64-bit branch of its bounded sampler, which
    shuffles of more than 2^32 samples use) and a plain shuffle."""
    draws = numpy.random.RandomState(1234).randint(0, 2**40, size=6, dtype=numpy.int64)
    permutation = numpy.arange(97)
    numpy.random.RandomState(5).shuffle(permutation)
    return {
        "bounded_draws": {"seed": 1234, "max": 2**40 - 1, "values": draws.tolist()},
        "shuffle": {"seed": 5, "size": 97, "values": permutation.tolist()},
    }


def main():
    folder = sys.argv[1] if len(sys.argv) > 1 else "tests/data/megatron_indexed"
    installed = metadata.version("megatron-core")
    if installed != MEGATRON_CORE_VERSION:
        sys.exit(f"expected megatron-core=={MEGATRON_CORE_VERSION}, got {installed}")
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory() as cache_folder:
        datasets = [
            # The full uint16 range; train asks for about 2.4 epochs, so Megatron shuffles the
            # final epoch separately; valid draws one epoch (num_samples None).
            describe_dataset(
                folder,
                "gpt_uint16",
                numpy.uint16,
                65536,
                {"num_documents": 60, "data_seed": 2024, "random_seed": 1234, "sequence_length": 32,
                 "split": "80,15,5"},
                [180, None, None],
                cache_folder,
            ),
            # int32 ids past uint16 (a 256k vocabulary); train asks for about 1.9 epochs, so
            # the final epoch is shuffled with the others.
            describe_dataset(
                folder,
                "gpt_int32",
                numpy.int32,
                262144,
                {"num_documents": 24, "data_seed": 7, "random_seed": 31, "sequence_length": 17,
                 "split": "70,20,10"},
                [100, None, None],
                cache_folder,
            ),
        ]
        blend = describe_blend(
            folder,
            ["gpt_uint16", "gpt_int32"],
            [0.3, 0.7],
            {"random_seed": 99, "sequence_length": 16, "split": "80,20"},
            [60, 20, 0],
            cache_folder,
        )
        # Unweighted: train asks for fewer samples than one epoch of both holds, valid for more
        # (so Megatron caps it at their sum).
        unweighted_blend = describe_blend(
            folder,
            ["gpt_uint16", "gpt_int32"],
            None,
            {"random_seed": 99, "sequence_length": 16, "split": "80,20"},
            [60, 1000, 0],
            cache_folder,
        )
    expected = {
        "generator": "tools/make_indexed_fixture.py",
        "megatron_core_version": installed,
        "numpy_version": numpy.__version__,
        "split_ranges": describe_split_ranges(),
        "random_state": describe_random_state(),
        "datasets": datasets,
        "blend": blend,
        "unweighted_blend": unweighted_blend,
    }
    torch.distributed.destroy_process_group()
    with open(os.path.join(folder, "expected.json"), "w") as stream:
        json.dump(expected, stream, separators=(",", ":"))
        stream.write("\n")


if __name__ == "__main__":
    main()
