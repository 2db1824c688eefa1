"""tiercache: tiered KV-cache offloading for LLM inference.

The engine room. Nothing in this package imports vLLM: the vLLM side lives in
``tiercache.connector`` (source folder ``connector/``), the storage media in
``tiercache.backends`` (source folder ``backends/``).

Rooms, each a sub-package whose ``__init__`` says what it owns and may import
(docs/architecture.md, Rooms; tests/unit/test_rooms.py keeps it so): ``cli``
-> ``server`` -> ``manager`` | ``transfer`` | ``pd`` -> ``tiers`` -> the
vocabulary every room shares, in this folder: ``backend`` (the plugin
contract), ``keys``, ``jobs`` (what the scheduler hands the worker), ``layout``,
``shards``, ``faults``, ``events``, ``metrics``, ``integrity`` (with ``mac``),
``counters``, ``buffers``, ``nixl_vetting`` (a peer's NIXL metadata loaded in a
throwaway process first); and ``config`` below them all. ``testing`` is the kit for tests
and plugin authors. Nothing here imports ``tiercache.backends`` or
``tiercache.connector``.
"""

__version__ = "0.1.0"
