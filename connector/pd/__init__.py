"""Prefill/decode hand-off, vLLM side: the P/D role objects the connector's halves hold.

May import: tiercache.pd, tiercache.manager, tiercache.transfer, vLLM.
"""
