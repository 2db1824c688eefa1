"""Repository-wide pytest hooks.

NIXL 1.5.1's UCX agent segfaults this process at interpreter exit, after every
test has run and been reported, even when the agent was deleted (reproduced
with a bare ``nixl_agent(...)`` in ``python -c``). Tests that use NIXL run the
client side in the pytest process, so without this hook a fully green run would
exit with 139. When NIXL was imported, we end the process ourselves with
pytest's own exit status, after the summary is printed and the streams flushed.
"""

from __future__ import annotations

import os
import sys

import pytest

_exit_status = 0


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if "nixl._api" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status)
