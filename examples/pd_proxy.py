"""A small prefill/decode proxy for two vLLM OpenAI servers running tiercache (or NixlConnector).

    python examples/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

For each ``POST /v1/completions`` (or ``/v1/chat/completions``) it receives, the proxy

1. sends the request to the **prefill** server with ``max_tokens: 1``, no
   streaming, and ``kv_transfer_params: {"do_remote_decode": true}``: the
   prefill engine computes the prompt's KV, keeps it for the decode engine
   and answers with ``kv_transfer_params`` saying where it is;
2. sends the original request to the **decode** server with those
   ``kv_transfer_params``: the decode engine reads the KV instead of
   recomputing the prompt, and generates;
3. relays the decode server's answer (streamed or not) to the client.

It speaks the same protocol as vLLM's own P/D proxies (the params have
NixlConnector's shape), so those work with tiercache unchanged, and this one
works with NixlConnector. If the prefill server fails, the request goes to
the decode server alone (it then prefills itself). Other paths are forwarded
to the decode server. Standard library only; one thread per request.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger("pd_proxy")

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class Upstream:
    """One vLLM server, by base URL (http://host:port)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise SystemExit(f"pd_proxy: {url!r}: expected http://host:port")
        self.host, self.port, self.timeout_s = parts.hostname, parts.port or 80, timeout_s

    def request(self, method: str, path: str, body: bytes | None,
                headers: dict[str, str]) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        conn.request(method, path, body=body, headers=headers)
        return conn, conn.getresponse()


def prefill(upstream: Upstream, path: str, request: dict[str, Any]) -> dict[str, Any] | None:
    """Run the prompt on the prefill server; the kv_transfer_params it hands back (None: failed)."""
    body = dict(request, max_tokens=1, stream=False, kv_transfer_params=PREFILL_PARAMS)
    body.pop("stream_options", None)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    try:
        conn, resp = upstream.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            data = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            logger.warning("prefill answered %d: %s", resp.status, data[:300])
            return None
        params = json.loads(data).get("kv_transfer_params")
        return params if isinstance(params, dict) else None
    except (OSError, ValueError, http.client.HTTPException) as exc:
        logger.warning("prefill server unreachable or confused (%s): the decode server prefills itself", exc)
        return None


def make_handler(prefill_server: Upstream, decode_server: Upstream) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path.startswith(("/v1/completions", "/v1/chat/completions")):
                try:
                    request = json.loads(body)
                except ValueError:
                    self._reply(400, b'{"error": "request body is not JSON"}')
                    return
                params = prefill(prefill_server, self.path, request)
                if params is not None:
                    request["kv_transfer_params"] = params
                body = json.dumps(request).encode()
            self._relay("POST", body)

        def do_GET(self) -> None:  # noqa: N802
            self._relay("GET", None)

        def _relay(self, method: str, body: bytes | None) -> None:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            try:
                conn, resp = decode_server.request(method, self.path, body, headers)
            except (OSError, http.client.HTTPException) as exc:
                self._reply(502, json.dumps({"error": f"decode server: {exc}"}).encode())
                return
            try:
                self.send_response(resp.status)
                for key, value in resp.getheaders():
                    if key.lower() not in HOP_HEADERS:
                        self.send_header(key, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while chunk := resp.read1(65536):  # streams (SSE) pass through as they come
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            finally:
                conn.close()

        def _reply(self, status: int, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, fmt: str, *args: Any) -> None:
            logger.info("%s " + fmt, self.address_string(), *args)

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", required=True, help="prefill server base URL, e.g. http://127.0.0.1:8100")
    parser.add_argument("--decode", required=True, help="decode server base URL, e.g. http://127.0.0.1:8200")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for either server")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pd_proxy %(levelname)s %(message)s")
    handler = make_handler(Upstream(args.prefill, args.timeout), Upstream(args.decode, args.timeout))
    server = ThreadingHTTPServer((args.host, args.port), handler)
    logger.info("listening on http://%s:%d (prefill %s, decode %s)", args.host, args.port, args.prefill, args.decode)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
