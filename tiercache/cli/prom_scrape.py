"""Read a Prometheus ``/metrics`` page: the ``tiercache_*`` samples, or an error that says why not.

Used by ``tiercache inspect engine``. The page is vLLM's own ``/metrics`` (on
the engine's API port, where tiercache's connector metrics appear) or a
standalone tiercache metrics port (``metrics.port``). Every failure is a
:class:`ScrapeError` whose text tells the user what the address is and what
to try: nothing listening, a port that does not speak HTTP (a cache server's
protocol port), a page that is not Prometheus text, a page without tiercache
metrics (tiercache not enabled on that engine), or a cache server's own
metrics page (``tiercache_server_*``: use ``tiercache inspect server``).
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlsplit

ENGINE_PREFIX = "tiercache_"
SERVER_PREFIX = "tiercache_server_"


class ScrapeError(Exception):
    """The page could not be read as an engine's tiercache metrics; the text says why and what to try."""


@dataclass(frozen=True)
class Sample:
    name: str  # the exposition name, suffix included (``tiercache_hit_tokens_total``)
    labels: dict[str, str] = field(default_factory=dict)
    value: float = 0.0

    @property
    def base(self) -> str:
        """The name without a counter's ``_total`` suffix."""
        return self.name.removesuffix("_total")


def normalize_url(url: str) -> str:
    """``HOST:PORT`` -> ``http://HOST:PORT/metrics``; a URL without a path gets ``/metrics``."""
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.path in ("", "/"):
        url = url.rstrip("/") + "/metrics"
    return url


def fetch(url: str, timeout_s: float = 5.0) -> str:
    """The page's text; ScrapeError naming the address on any failure."""
    where = urlsplit(url).netloc
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        path = urlsplit(url).path
        hint = (f"try http://{where}/metrics" if path != "/metrics" else
                "is it a vLLM engine? vLLM serves /metrics on its API port")
        raise ScrapeError(f"{url} answered HTTP {exc.code} ({exc.reason}): {hint}") from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, ConnectionRefusedError):
            raise ScrapeError(f"nothing listens at {where} ({url}): is the engine running? vLLM serves "
                              "/metrics on its API port (default 8000)") from None
        raise ScrapeError(f"cannot reach {url}: {reason}") from None
    except (http.client.HTTPException, ConnectionResetError) as exc:
        raise ScrapeError(f"{where} does not speak HTTP ({type(exc).__name__}): is it a tiercache cache "
                          f"server? try `tiercache inspect server {where}`") from None
    except TimeoutError:
        raise ScrapeError(f"{url} did not answer within {timeout_s:g} s") from None
    except OSError as exc:
        raise ScrapeError(f"cannot read {url}: {exc}") from None


def parse(text: str, url: str = "the page") -> list[Sample]:
    """Every ``tiercache_*`` sample of a Prometheus text page (``_created`` samples left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ScrapeError(f"{url} is not a Prometheus metrics page ({exc}); vLLM serves its metrics at "
                          "/metrics on the API port") from None
    return [
        Sample(s.name, dict(s.labels), float(s.value))
        for family in families if family.name.startswith(ENGINE_PREFIX)
        for s in family.samples if not s.name.endswith("_created")
    ]


def engine_samples(url: str, timeout_s: float = 5.0) -> list[Sample]:
    """The engine's tiercache samples at ``url``; ScrapeError when there are none, saying why."""
    samples = parse(fetch(url, timeout_s), url)
    engine = [s for s in samples if not s.name.startswith(SERVER_PREFIX)]
    if engine:
        return engine
    where = urlsplit(url).netloc
    if samples:
        raise ScrapeError(f"{url} is a tiercache cache server's metrics page (tiercache_server_*), not an "
                          "engine's: `tiercache inspect server HOST:PORT` shows a server (its protocol "
                          f"port, not {where})")
    raise ScrapeError(f"{url} has no tiercache_* metrics: is this engine started with tiercache "
                      "(--kv-transfer-config with TierCacheConnector)? Its metrics appear once the engine "
                      "is up; a standalone tiercache metrics port (metrics.port) works too")
