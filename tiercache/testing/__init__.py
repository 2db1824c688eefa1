"""Test kit shipped with tiercache.

* ``random_llama``: small Llama checkpoints with context-sensitive random
  weights (vLLM's dummy weights hide wrong KV; these do not);
* ``engine_runner``: runs a real vLLM engine over a JSON spec in a subprocess
  with a timeout, for end-to-end tests, benchmarks and the demo (its
  ``worker_call`` rounds run a function inside the engine's workers;
  ``engine_metrics`` takes its metric snapshots; ``engine_launch`` is the
  test side that starts it and waits for its result);
* ``raw_nixl``: raw NIXL UCX READs between plain memory, the P/D ceiling, also
  measured from inside a decode engine's worker (bench/pd.py).
* ``vllm_views``: the KV views vLLM 0.32 hands a connector, built with vLLM's own
  code (or tables proven equal to it where vLLM is absent), and
  ``layout_checks``: the token-by-token round trip of such views through the
  host tier (tests/unit/test_vllm_layouts.py, tests/gpu/test_layouts_cuda.py).

The backend conformance kit (``conformance``: the contract tests;
``conformance_shards``: the same medium through store shards;
``conformance_harness``: how those tests drive a backend; ``payloads``: keys
and payload bytes) joins them with the disk/LMDB tiers.
"""
