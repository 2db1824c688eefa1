"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pathlib
import shutil

import pytest

from tiercache.testing.random_llama import config_path
from tiercache.testing.word_tokenizer import write_word_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny test model's config with the word tokenizer beside it (what bench/serve.py loads)."""
    model = tmp_path_factory.mktemp("tiny")
    shutil.copyfile(config_path("tiny"), model / "config.json")
    return write_word_tokenizer(model)
