"""A small synchronous client for the control API (stdlib only, so the CLI stays light)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from pydantic import BaseModel

from pdx.errors import MeasurementError, PdxError


class ControlError(PdxError):
    """The control API refused a request; the message is the server's one-line reason."""


class ControlClient:
    """Drive a running proxy through ``http://HOST:PORT`` (its ``--api`` address)."""

    blocking = True  # timelines call it from a worker thread

    def __init__(self, url: str, timeout_s: float = 5.0, *, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        if not self.url.startswith("http"):
            self.url = "http://" + self.url
        self.timeout_s = timeout_s
        self.token = token

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """Send one request; JSON in and out; errors become one-line exceptions."""
        data = None if body is None else json.dumps(_plain(body)).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise ControlError(_reason(exc)) from None
        except (urllib.error.URLError, OSError) as exc:
            why = getattr(exc, "reason", exc)
            raise MeasurementError(f"control API {self.url} not reachable ({why})") from None
        if not raw:
            return None
        if path == "/metrics":
            return raw.decode()
        return json.loads(raw)

    def list_toxics(self) -> list[dict[str, Any]]:
        """All toxics."""
        return self.request("GET", "/toxics")  # type: ignore[no-any-return]

    def add_toxic(self, toxic: Any) -> dict[str, Any]:
        """Add a toxic (dict or toxic model)."""
        return self.request("POST", "/toxics", toxic)  # type: ignore[no-any-return]

    def update_toxic(self, name: str, changes: dict[str, Any] | None = None) -> dict[str, Any]:
        """Change a toxic's attributes."""
        return self.request("PATCH", f"/toxics/{name}", changes or {})  # type: ignore[no-any-return]

    def remove_toxic(self, name: str) -> None:
        """Remove a toxic."""
        self.request("DELETE", f"/toxics/{name}")

    def clear_toxics(self) -> None:
        """Remove every toxic."""
        for toxic in self.list_toxics():
            self.remove_toxic(toxic["name"])

    def link_down(self, duration_s: float | None = None, mode: str = "reset") -> dict[str, Any]:
        """Take the link down."""
        body: dict[str, Any] = {"mode": mode}
        if duration_s is not None:
            body["duration_s"] = duration_s
        return self.request("POST", "/link/down", body)  # type: ignore[no-any-return]

    def link_up(self) -> dict[str, Any]:
        """Bring the link up."""
        return self.request("POST", "/link/up", {})  # type: ignore[no-any-return]

    def stats(self) -> dict[str, Any]:
        """The proxy's stats."""
        return self.request("GET", "/stats")  # type: ignore[no-any-return]

    def metrics_text(self) -> str:
        """Prometheus text."""
        return self.request("GET", "/metrics")  # type: ignore[no-any-return]


def _plain(body: Any) -> Any:
    return body.model_dump() if isinstance(body, BaseModel) else body


def _reason(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read())["error"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {exc.code} {exc.reason}"
