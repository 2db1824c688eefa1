"""Configuration: the engine config schema (pydantic), its YAML loading, byte-size parsing.

Owns: :mod:`.schema` (TierCacheConfig and its parts), :mod:`.pd` (its P/D section), :mod:`.yaml_file`,
:mod:`.sizes`.
May import: the standard library, pydantic, yaml. Nothing else of tiercache: every room reads its config.
"""
