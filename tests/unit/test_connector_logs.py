"""tiercache's log records inside a vLLM process: routed to vLLM's handlers, level from the environment."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest
from tiercache.connector.logs import adopt_vllm_logging

from tiercache.config.schema import ConfigError, load_config


@pytest.fixture
def loggers() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A stand-in for vLLM's configured ``vllm`` logger; both loggers restored afterwards."""
    ours, theirs = logging.getLogger("tiercache"), logging.getLogger("vllm")
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in (ours, theirs)]
    for lg in (ours, theirs):
        lg.handlers = []
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    theirs.addHandler(handler)
    theirs.setLevel(logging.INFO)
    yield ours, out
    for lg, handlers, level, propagate in saved:
        lg.handlers, lg.level, lg.propagate = handlers, level, propagate


def test_info_lines_land_in_vllms_log_once(loggers) -> None:
    ours, out = loggers
    logging.getLogger("tiercache.connector.worker").info("before")  # nowhere: not adopted yet
    adopt_vllm_logging()
    adopt_vllm_logging()  # idempotent
    logging.getLogger("tiercache.connector.worker").info("geometry")
    logging.getLogger("tiercache.pd.peer_tier").debug("hidden")
    assert out.getvalue().splitlines() == ["INFO tiercache.connector.worker geometry"]
    assert len(ours.handlers) == 1 and not ours.propagate


def test_level_from_the_config_and_the_environment(loggers, monkeypatch) -> None:
    _ours, out = loggers
    monkeypatch.setenv("TIERCACHE_LOG_LEVEL", "debug")
    config = load_config()
    assert config.log_level == "DEBUG"
    adopt_vllm_logging(config.log_level)
    logging.getLogger("tiercache.pd.peer_tier").debug("READ 4.0 ms")
    logging.getLogger("vllm.engine").debug("vllm's own debug stays filtered by its logger")
    assert out.getvalue().splitlines() == ["DEBUG tiercache.pd.peer_tier READ 4.0 ms"]


def test_a_bad_level_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="log_level"):
        load_config(log_level="chatty")


def test_user_configured_logging_is_left_alone(loggers) -> None:
    ours, out = loggers
    mine = logging.StreamHandler(io.StringIO())
    ours.addHandler(mine)
    adopt_vllm_logging()
    assert ours.handlers == [mine] and out.getvalue() == ""
