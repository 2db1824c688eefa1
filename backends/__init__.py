"""Storage media for tiercache, one module per medium (installed as ``tiercache.backends``).

Each is a plugin exactly like a third-party one: registered under the entry
point group ``tiercache.backends`` and found by name from YAML.
"""
