"""tiercache's presets: the YAML files beside this file, shipped in the package as ``tiercache.presets``.

An engine names one without a path (``"kv_connector_extra_config": {"preset": "cpu"}``);
tiercache/config/presets.py finds them. ``server.yaml`` is the cache server's
(``tiercache server --config``), not an engine preset.
"""
