"""The vLLM side of tiercache (installed as ``tiercache.connector``).

``vllm.py`` is the connector class vLLM loads; ``scheduler.py`` and
``worker.py`` hold its two halves; ``metadata.py`` is what crosses between them.
"""
