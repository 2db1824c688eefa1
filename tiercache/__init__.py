"""tiercache: tiered KV-cache offloading for LLM inference.

The engine room. Nothing in this package imports vLLM: the vLLM side lives in
``tiercache.connector`` (source folder ``connector/``), the storage media in
``tiercache.backends`` (source folder ``backends/``).
"""

__version__ = "0.1.0"
