"""Fixtures for the gateway tests; the helpers behind them live in gateway_util.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from transformers import PreTrainedTokenizerFast

from gateway_util import API_KEY, LiveServer, make_app, make_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture
def live(tokenizer) -> Iterator[LiveServer]:
    with LiveServer(make_app(tokenizer, api_key=API_KEY)) as server:
        yield server
