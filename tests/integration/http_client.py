"""The router's OpenAI routes as plain HTTP for integration tests: a 200 JSON body, or a
stream's events (without `[DONE]`), asserting the status on the way."""

from __future__ import annotations

import json

import httpx


def post_json(base_url: str, path: str, body: dict, timeout: float = 60) -> dict:
    resp = httpx.post(base_url + path, json=body, timeout=timeout)
    assert resp.status_code == 200, resp.text
    return resp.json()


def stream_events(base_url: str, path: str, body: dict, timeout: float = 60) -> list[dict]:
    events = []
    with httpx.stream("POST", base_url + path, json={**body, "stream": True}, timeout=timeout) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events

