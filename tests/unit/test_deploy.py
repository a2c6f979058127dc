"""The deploy configs send every streaming route of the app to a location that streams.

A route nginx serves from its default `location /` is buffered and cut after 60 s of quiet:
it worked only because of `X-Accel-Buffering: no` and the heartbeat (issue 26). The routes
come from the app itself (`HOT_ROUTES`, the streaming endpoints), so a new one fails here
until the configs list it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from firsttoken.app import HOT_ROUTES

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NGINX_CONFS = sorted(DEPLOY.glob("nginx*.conf"))
CADDYFILES = sorted(DEPLOY.glob("Caddyfile*"))
# The streaming route HOT_ROUTES finds by its shape rather than by key: a stream's events.
EVENTS = "/v1/streams/0123abcd/events"
_LOCATION = re.compile(r"^\s*location\s+(?:(=|~\*?|\^~)\s+)?(\S+)\s*\{(.*?)^\s*\}", re.M | re.S)


def streaming_paths() -> list[str]:
    return sorted({path for _, path in HOT_ROUTES} | {EVENTS})


def chosen_location(text: str, path: str) -> str:
    """The block of the location nginx picks for `path`: an exact match; else the longest
    prefix if it is `^~`; else the first regex that matches; else the longest prefix."""
    prefixes: list[tuple[str, str]] = []
    for modifier, pattern, block in _LOCATION.findall(text):
        if modifier == "=" and pattern == path:
            return block
        if modifier in ("", "^~") and path.startswith(pattern):
            prefixes.append((pattern, block))
    longest = max(prefixes, key=lambda p: len(p[0]), default=None)
    if longest is not None and re.search(r"location\s+\^~\s+" + re.escape(longest[0]), text):
        return longest[1]
    for modifier, pattern, block in _LOCATION.findall(text):
        flags = re.I if modifier == "~*" else 0
        if modifier.startswith("~") and re.search(pattern, path, flags):
            return block
    assert longest is not None, f"no location serves {path}"
    return longest[1]


def test_the_configs_and_routes_are_found() -> None:
    assert len(NGINX_CONFS) >= 2  # nginx.conf and nginx-multi.conf
    assert "/v1/responses" in streaming_paths() and "/v1/messages" in streaming_paths()


@pytest.mark.parametrize("conf", NGINX_CONFS, ids=lambda p: p.name)
@pytest.mark.parametrize("path", streaming_paths())
def test_every_streaming_route_is_served_unbuffered(conf: Path, path: str) -> None:
    block = chosen_location(conf.read_text(), path)
    assert re.search(r"proxy_buffering\s+off;", block), f"{conf.name}: {path} is buffered"
    assert re.search(r"proxy_read_timeout\s+\d{3,}s;", block), f"{conf.name}: {path} times out"


def test_the_location_rules_are_nginx_s() -> None:
    text = "".join(
        f"location {spec} {{\n    {name};\n}}\n"
        for spec, name in [
            ("= /exact", "A"),
            ("^~ /static/", "B"),
            ("~ ^/v1/(x|y)", "C"),
            ("/v1/", "D"),
            ("/", "E"),
        ]
    )
    paths = ("/exact", "/static/a", "/v1/x", "/v1/z", "/other")
    pick = {p: chosen_location(text, p).strip() for p in paths}
    assert pick == {"/exact": "A;", "/static/a": "B;", "/v1/x": "C;", "/v1/z": "D;", "/other": "E;"}


@pytest.mark.parametrize("conf", CADDYFILES, ids=lambda p: p.name)
def test_caddy_proxies_every_route_unbuffered(conf: Path) -> None:
    """Caddy: one catch-all `reverse_proxy` that flushes every chunk serves every streaming
    route. A path matcher would need the routes' list checked here, as for nginx."""
    text = "\n".join(line.split("#", 1)[0] for line in conf.read_text().splitlines())
    targets = re.findall(r"^\s*reverse_proxy\s+(\S+)", text, re.M)
    assert targets, f"{conf.name}: no reverse_proxy"
    routed = [t for t in targets if t.startswith(("/", "@", "*"))]
    routed += re.findall(r"^\s*(?:handle|handle_path|route)\s+\S+", text, re.M)
    assert not routed, f"{conf.name} routes by path ({routed}): check {streaming_paths()}"
    assert len(re.findall(r"^\s*flush_interval\s+-1\s*$", text, re.M)) == len(targets)
    assert not re.search(r"^\s*encode\b", text, re.M), f"{conf.name} compresses the streams"
