"""Storage media for tiercache, one sub-package per store (installed as ``tiercache.backends``).

``disk/``, ``lmdb/``, ``redis/``, ``server/``: each a ``backend.py`` (the
:class:`~tiercache.backend.Backend`) and the modules it alone uses. Each is a
plugin exactly like a third-party one: registered under the entry point group
``tiercache.backends`` and found by name from YAML. They build on the core
(the contract, ``tiercache.tiers.worker_lanes``' job records and lanes,
``tiercache.integrity``), never on each other, the connector, the manager or
the transfer engine (tests/unit/test_rooms.py).
"""
