"""A word-level tokenizer for the random-weight test models, written without any download.

The test models (:mod:`tiercache.testing.random_llama`) have weights and a
config but no tokenizer; the engine tests run them with
``skip_tokenizer_init``. vLLM's load generator (``vllm bench serve``, module
``vllm.benchmarks.serve``) needs one: its ``prefix_repetition`` and ``random``
datasets draw random token ids, decode them to text and encode the text again.
:func:`write_word_tokenizer` puts a tokenizer in the model directory that
makes that round trip exact: token ``i`` is the word ``w<i>`` (``w0`` ...
``w{V-1}`` for the model's ``vocab_size`` V), a whitespace pre-tokenizer splits
text into words, and decoding joins the words with single spaces. So
``encode(decode(ids)) == ids`` for every list of ids in ``range(V)``.

There are no special tokens (no BOS is added, nothing is skipped when
decoding): an added token such as ``w2`` would also match inside ``w23``
and break the round trip. ``tokenizer_config.json`` names transformers'
``PreTrainedTokenizerFast`` so ``AutoTokenizer`` (and so the vLLM server)
loads ``tokenizer.json`` directly.

Library: ``write_word_tokenizer(model_dir)``; ``word_of(i)``.
CLI: ``python -m tiercache.testing.word_tokenizer MODEL_DIR``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

TOKENIZER_NAME = "tokenizer.json"
CONFIG_NAME = "tokenizer_config.json"


def word_of(token_id: int) -> str:
    """The word that stands for ``token_id``: ``7 -> "w7"``."""
    return f"w{token_id}"


def vocab_size_of(model_dir: pathlib.Path) -> int:
    """``vocab_size`` from ``model_dir/config.json``."""
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    return int(config["vocab_size"])


def build_tokenizer(vocab_size: int):  # -> tokenizers.Tokenizer (imported lazily)
    """The ``tokenizers.Tokenizer`` of ``w0`` ... ``w{vocab_size-1}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word_of(i): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=word_of(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok  # no decoder: decode joins the words with one space


def write_word_tokenizer(model_dir: pathlib.Path, max_len: int | None = None) -> pathlib.Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``model_dir``; returns it.

    Rewrites both only when their content would change, so engines reading the
    directory at the same time see whole files. ``max_len`` (default: the
    config's ``max_position_embeddings``) becomes ``model_max_length``.
    """
    model_dir = pathlib.Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    limit = int(max_len or config.get("max_position_embeddings", 1 << 20))
    tokenizer_text = build_tokenizer(vocab_size).to_str(pretty=False)
    config_text = json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": limit,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }, indent=1)
    for name, text in ((TOKENIZER_NAME, tokenizer_text), (CONFIG_NAME, config_text)):
        path = model_dir / name
        if not path.is_file() or path.read_text() != text:
            tmp = path.with_name(f".{name}.tmp")
            tmp.write_text(text)
            tmp.replace(path)
    return model_dir


def main(argv: list[str] | None = None) -> int:
    """CLI: write the tokenizer into a model directory and print the directory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=pathlib.Path, help="a directory holding config.json")
    args = parser.parse_args(argv)
    print(write_word_tokenizer(args.model_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
