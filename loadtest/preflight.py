"""Before a run: is there a server at ``--base-url``, which model does it serve, and does it
accept one request shaped as the run's will be? Each mistake becomes one ``ValueError`` naming
the flag to change, with the server's own message, instead of a run of identical failures."""

from __future__ import annotations

from dataclasses import replace

import httpx

from loadtest.client import ClientConfig, request_body, server_message

PROBE_TEXT = "Hello"


def _get_models(http: httpx.Client, base_url: str) -> httpx.Response:
    url = base_url.rstrip("/") + "/v1/models"
    try:
        return http.get(url)
    except httpx.ConnectError:
        raise ValueError(
            f"--base-url {base_url}: nothing answers there (connection refused); start the "
            "server (e.g. `pdserve up`) or pass the URL it listens on"
        ) from None
    except httpx.HTTPError as exc:
        raise ValueError(f"--base-url {base_url}: GET {url} failed ({exc!r})") from None


def _served(response: httpx.Response) -> list[str]:
    try:
        return [str(m["id"]) for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        return []


def preflight(cfg: ClientConfig, model: str | None) -> str:
    """Check the server and return the model to use (``model``, or the first one
    ``/v1/models`` lists). Raises ``ValueError`` with a one-line explanation."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    timeout = httpx.Timeout(cfg.request_timeout, connect=min(cfg.request_timeout, 10.0))
    with httpx.Client(headers=headers, timeout=timeout, trust_env=False) as http:
        listing = _get_models(http, cfg.base_url)
        status, served = listing.status_code, _served(listing)
        if status in (401, 403):
            raise ValueError(
                f"{listing.request.url} answered {status}: {server_message(listing.text)}; "
                "pass the server's key with --api-key"
            )
        if model is None:
            if not served:
                raise ValueError(
                    f"{listing.request.url} answered {status} with no model listed; "
                    "name the model with --model"
                )
            model = served[0]
        body = request_body(replace(cfg, model=model, stream=False), _probe_prompt(cfg), 1)
        try:
            answer = http.post(cfg.url, json=body)
        except httpx.HTTPError as exc:
            raise ValueError(f"the probe request to {cfg.url} failed ({exc!r})") from None
    if answer.status_code != 200:
        raise ValueError(
            f"the probe request to {cfg.url} answered {answer.status_code}: "
            f"{server_message(answer.text)}{_hint(answer.status_code, model, served)}"
        )
    return model


def _probe_prompt(cfg: ClientConfig) -> str | list[dict[str, str]]:
    return [{"role": "user", "content": PROBE_TEXT}] if cfg.chat else PROBE_TEXT


def _hint(status: int, model: str, served: list[str]) -> str:
    """What to change, for the usual causes of a refused probe."""
    if status in (401, 403):
        return " (pass the server's key with --api-key)"
    if status == 404 and served and model not in served:
        return f" (--model {model}: the server serves {', '.join(served)})"
    if status == 404:
        return " (check --endpoint: /v1/completions or /v1/chat/completions)"
    if status >= 500:
        return " (the server is not ready or failing; see its log)"
    return ""
