"""What the engine fork server imports once, so that each engine runner it forks starts warm.

Importing ``vllm.LLM`` costs ~10 s of one core on the 2-core CI machine, every
engine runner paid it, and the test suite starts about a hundred runners.
:mod:`tiercache.testing.engine_forkserver` names this module as the fork
server's preload: the server imports it once, and every runner forked from the
server finds vLLM's modules already imported.

Only imports happen here, nothing that starts a thread or an OpenMP pool (a
forked child would inherit a pool without its threads). vLLM reads its
environment variables when they are used, not at import
(``vllm.envs.__getattr__``; the cache ``enable_envs_cache`` is switched on by an
engine, never by an import), so a runner's ``apply_env`` after the fork still
decides them. The runner's default environment is set first all the same, so
the import sees what a fresh runner's import sees.
"""

from __future__ import annotations

import importlib
import os

from tiercache.testing.engine_runner import DEFAULT_ENV

for _key, _value in DEFAULT_ENV.items():
    os.environ.setdefault(_key, _value)

for _module in ("vllm.entrypoints.llm", "vllm.inputs", "vllm.sampling_params"):
    try:
        importlib.import_module(_module)
    except ImportError:  # no vLLM here: each runner fails on its own import, with vLLM's message
        break
