"""The vLLM side of tiercache (installed as ``tiercache.connector``).

``vllm.py`` is the connector class vLLM loads; ``scheduler.py`` and
``worker.py`` hold its two halves (with ``scheduler_state.py``,
``scheduler_stores.py``, ``scheduler_faults.py`` and ``worker_faults.py``); ``metadata.py`` is what
crosses between them. ``pd/`` is prefill/decode's vLLM side, reached by each
half through one role object (``pd/roles.py``). The rest translates vLLM's
view into tiercache's: ``engine_info.py`` (with ``kv_groups.py``: a hybrid
model's KV-cache groups, and ``state_chunks.py``: a state-layer model's states), ``model_identity.py``,
``namespace_check.py``, ``lower_tiers.py``, ``prompt_tail.py``,
``block_pins.py``, ``store_pins.py``, ``events.py`` (with ``event_blocks.py``), ``stats.py``, ``logs.py``,
``guard.py``; ``inactive.py`` holds the null halves for a model tiercache
declines (vLLM serves it alone).
May import anything of tiercache, and vLLM.
"""
