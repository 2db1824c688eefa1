"""connector/inactive.py: the connector's halves when tiercache declines a model, behind the real facade.

Every vLLM-facing method answers as if no connector were there (a miss, no jobs,
nothing finished, nothing held), and none of them counts a connector fault: the
engine serves the model alone. Control: the same facade over halves that raise
counts faults, so the fault count below could see one.
"""

from __future__ import annotations

from types import SimpleNamespace

from tiercache import faults
from tiercache.connector.inactive import InactiveScheduler, InactiveWorker
from tiercache.connector.metadata import TierCacheConnectorMetadata
from tiercache.connector.vllm import TierCacheConnector


def facade(scheduler: object, worker: object) -> TierCacheConnector:
    conn = object.__new__(TierCacheConnector)
    conn._scheduler, conn._worker, conn._namespace = scheduler, worker, None
    conn._connector_metadata = TierCacheConnectorMetadata()
    return conn


def drive(conn: TierCacheConnector) -> list[object]:
    req = SimpleNamespace(request_id="r", num_tokens=300, num_prompt_tokens=300, block_hashes=[])
    out = SimpleNamespace(kv_connector_worker_meta=None)
    conn.register_kv_caches({})
    return [
        conn.get_handshake_metadata(),
        conn.handle_preemptions(TierCacheConnectorMetadata()),
        conn.start_load_kv(None),
        conn.wait_for_save(),
        conn.get_finished({"r"}),
        conn.get_block_ids_with_load_errors(),
        conn.build_connector_worker_meta(),
        conn.get_num_new_matched_tokens(req, 0),  # type: ignore[arg-type]
        conn.update_state_after_alloc(req, SimpleNamespace(), 0),  # type: ignore[arg-type]
        conn.build_connector_meta(SimpleNamespace()),  # type: ignore[arg-type]
        conn.update_connector_output(out),  # type: ignore[arg-type]
        conn.request_finished_all_groups(req, ([1, 2], [3])),  # type: ignore[arg-type]
        conn.has_pending_push_work(),
        list(conn.take_events()),
        conn.get_kv_connector_stats(),
        conn.reset_cache(),
    ]


def test_a_declined_model_gets_the_answers_of_no_connector() -> None:
    faults.reset_for_tests()
    answers = drive(facade(InactiveScheduler("MambaSpec"), InactiveWorker("MambaSpec")))
    assert answers[4] == (set(), set())
    assert answers[5] == set()
    assert answers[7] == (0, False)
    assert isinstance(answers[9], TierCacheConnectorMetadata) and not answers[9].loads and not answers[9].stores
    assert answers[11] == (False, None)
    assert answers[12] is False and answers[13] == []
    assert faults.take() == {}  # nothing went wrong: no connector fault was counted


def test_control_halves_that_raise_are_counted() -> None:
    class Exploding:
        def __getattr__(self, name: str) -> object:
            def boom(*args: object, **kwargs: object) -> object:
                raise RuntimeError(name)
            return boom

    faults.reset_for_tests()
    conn = facade(Exploding(), Exploding())
    conn.get_num_new_matched_tokens(SimpleNamespace(request_id="r"), 0)  # type: ignore[arg-type]
    assert faults.take()  # the count above could see a fault
