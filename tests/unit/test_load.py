"""diag's client: which HTTP versions it offers for a URL (`_load.HttpVersions`)."""

from __future__ import annotations

import pytest

from firsttoken.tools._load import HttpVersions


@pytest.mark.parametrize(
    ("url", "http2", "offered"),
    [
        # TLS: both offered, the server picks (ALPN), --http2 or not.
        ("https://gw.example/v1/chat/completions", False, (True, True)),
        ("https://gw.example/v1/chat/completions", True, (True, True)),
        # Cleartext has no negotiation: HTTP/1.1, or HTTP/2 alone (prior knowledge) if asked.
        ("http://127.0.0.1:8000/v1/chat/completions", False, (True, False)),
        ("http://127.0.0.1:8000/v1/chat/completions", True, (False, True)),
    ],
)
def test_versions_offered_for_a_url(url: str, http2: bool, offered: tuple[bool, bool]) -> None:
    versions = HttpVersions.for_url(url, http2)
    assert (versions.http1, versions.http2) == offered

