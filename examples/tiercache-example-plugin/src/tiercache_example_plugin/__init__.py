"""An example tiercache storage backend (chunks in a dict), registered as ``example_memory``."""

from tiercache_example_plugin.backend import ExampleMemoryBackend, ExampleMemorySettings

__all__ = ["ExampleMemoryBackend", "ExampleMemorySettings"]
