"""The connector's edge: no exception from tiercache reaches vLLM once the engine serves.

:func:`contained` wraps a method of the vLLM-facing connector
(connector/vllm.py). An exception is counted (fault ``connector_exception``),
logged once with its cause and traceback (tiercache/faults.py rate-limits
repeats), and turned into the method's *safe answer*: no hit, no load, every
promised block failed (vLLM recomputes), nothing to report. The safe answer is
a constant or, where it depends on the call, a function of the same arguments
(``fallback``) that is itself guarded.

Start-up (``__init__``, ``register_kv_caches``) is not wrapped: a config or
layout that cannot work must stop the engine at once, naming the problem,
rather than serve without the cache it was asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from tiercache import faults

F = TypeVar("F", bound=Callable[..., Any])


def contained(safe: Any = None, fallback: Callable[..., Any] | None = None) -> Callable[[F], F]:
    """Decorate a connector method: on an exception return ``fallback(self, *args)`` or ``safe``."""

    def wrap(method: F) -> F:
        name = method.__name__

        @functools.wraps(method)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the point of this module
                faults.record(faults.CONNECTOR_EXCEPTION, exc, where=name)
                if fallback is None:
                    return safe() if callable(safe) else safe
                try:
                    return fallback(self, *args, **kwargs)
                except Exception as again:  # noqa: BLE001
                    faults.record(faults.CONNECTOR_EXCEPTION, again, where=f"{name}.fallback")
                    return safe() if callable(safe) else safe

        return guarded  # type: ignore[return-value]

    return wrap


# ------------------------------------------------------------------ the facade's safe answers
def fail_loads(connector: Any, *args: Any, **kwargs: Any) -> None:
    """``start_load_kv``: every load of the step is recomputed (its blocks reported failed)."""
    connector._w().fail_loads(connector._meta())


def fail_saves(connector: Any, *args: Any, **kwargs: Any) -> None:
    """``wait_for_save``: the stores and demotions not handed over fail (future misses)."""
    connector._w().fail_saves(connector._meta())


def fail_alloc(connector: Any, request: Any, blocks: Any, num_external_tokens: int) -> None:
    """``update_state_after_alloc``: the promised tokens are recomputed."""
    connector._s().fail_alloc(request, blocks, num_external_tokens)


def fallback_meta(connector: Any, scheduler_output: Any) -> Any:
    """``build_connector_meta``: no stores; the step's planned loads are recomputed."""
    return connector._s().fallback_meta()


def no_finished() -> tuple[set[str], set[str]]:
    return set(), set()


def no_transfer_results() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    return KVConnectorTransferResults()


NO_MATCH = (0, False)
NOT_DELAYED = (False, None)
