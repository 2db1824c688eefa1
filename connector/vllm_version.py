"""The vLLM versions tiercache's connector supports, checked when vLLM constructs it.

The connector reaches into vLLM's internals (the hybrid KV-cache manager's block
pool, the V2 model runner's hook order, the KV-cache layouts of 0.32), which
change between minor releases. Outside :data:`SUPPORTED_VLLM` the connector
refuses to start with an error naming both versions, before it allocates
anything; ``TIERCACHE_ALLOW_UNSUPPORTED_VLLM=1`` turns that into one WARNING,
for trying a new release at one's own risk.
"""

from __future__ import annotations

import logging
import os

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = SpecifierSet(">=0.32,<0.33")
OVERRIDE_ENV = "TIERCACHE_ALLOW_UNSUPPORTED_VLLM"


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is outside :data:`SUPPORTED_VLLM`."""


def check_vllm_version(installed: str | None = None) -> None:
    """Raise UnsupportedVLLMVersion unless ``installed`` (default: vllm.__version__) is supported."""
    if installed is None:
        import vllm

        installed = str(getattr(vllm, "__version__", "unknown"))
    try:
        ok = SUPPORTED_VLLM.contains(Version(installed), prereleases=True)
    except InvalidVersion:
        ok = False
    if ok:
        return
    message = (f"tiercache supports vLLM {SUPPORTED_VLLM} (tested: 0.32.0); this is vLLM {installed}. "
               f"Install a supported vLLM, or set {OVERRIDE_ENV}=1 to try this one at your own risk")
    if os.environ.get(OVERRIDE_ENV, "") not in ("", "0"):
        logger.warning("%s (going on: %s is set)", message, OVERRIDE_ENV)
        return
    raise UnsupportedVLLMVersion(message)
