"""Fixtures of the unit tests: the tiny model's tokenizer, built once per module."""

from __future__ import annotations

import pytest

from services.router.tokenization import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    """The router's Tokenizer over the tiny model's tokenizer (built locally, no hub)."""
    from apps.model.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return Tokenizer.load(path)
