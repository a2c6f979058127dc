"""Answers written in a style other than plain prose: Markdown, and hostile text that a page
must show as text. Deterministic: the caller's seeded generator decides everything.

Both styles are made of whole blocks (a heading, a list, a code fence, a table…) tokenised
the way a BPE vocabulary splits Markdown: a fence is ``"```"``, ``"python"``, ``"\\n"``; a
table row is ``"|"``, ``" Name"``, ``" |"``…; ``"**"`` is one token. So a renderer sees its
constructs open and close mid-stream, as it would with a real model. The last block that does
not fit is replaced by a paragraph of exactly the tokens left: an answer has `target` tokens
(at least one), and a long one is rich Markdown all the way through, not one section repeated.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator

__all__ = ["STYLES", "styled_answer", "styled_pieces", "tokenize"]

STYLES = ("prose", "markdown", "hostile")

# Fences and bold markers are one token; a word carries its leading space; other punctuation
# is a token per character; runs of spaces (code indentation) are one token.
_TOKEN = re.compile(r"\n| ?```| ?\*\*| ?\w+| ?[^\w\s]| +|\s")


def tokenize(text: str) -> list[str]:
    """Split `text` into tokens that concatenate back to it; long words in two pieces."""
    tokens: list[str] = []
    for piece in _TOKEN.findall(text):
        if len(piece) > 9 and piece.strip().isalpha():
            cut = 6 if piece[0] == " " else 5
            tokens += (piece[:cut], piece[cut:])
        else:
            tokens.append(piece)
    return tokens


def styled_answer(style: str, rng: random.Random, target: int) -> tuple[str, ...]:
    """About `target` tokens in `style` ("markdown" or "hostile"): exactly `target` when it
    is at least 1."""
    return tuple(token for piece in styled_pieces(style, rng, target) for token in piece)


def styled_pieces(style: str, rng: random.Random, target: int) -> Iterator[list[str]]:
    """`styled_answer`'s tokens a block at a time, drawn only as they are asked for: the
    engine builds no more of an answer than a request reads."""
    blocks = _hostile_blocks(rng) if style == "hostile" else _markdown_blocks(rng)
    built = 0
    target = max(target, 1)
    while built < target:
        block = tokenize(next(blocks))
        if built + len(block) > target:
            block = _filler(rng, target - built)
        built += len(block)
        yield block


# ---- words ------------------------------------------------------------------------------------

_WORDS = (
    "stream token answer server client reader browser network latency buffer event gateway "
    "engine request response paragraph moment screen text first quickly steady visible "
    "waiting reading sending arrives starts stops keeps shows measures carries delivers "
    "resumes connection heartbeat throughput backpressure compression the a of to and with "
    "for every each while before after"
).split()
_TOPICS = (
    "Streaming basics",
    "Time to first token",
    "Resuming a stream",
    "Backpressure",
    "Cancelling early",
    "Heartbeats",
    "Proxies and buffering",
    "Measuring throughput",
    "Chunk coalescing",
    "Failure modes",
    "Keys and limits",
    "Reading the metrics",
)
_TERMS = (
    "Last-Event-ID",
    "text/event-stream",
    "retry: 1000",
    "max_tokens",
    "X-Accel-Buffering",
    "resume_token",
    "EventSource",
    "[DONE]",
)
_NAMES = ("alpha", "beta", "gamma", "delta", "relay", "cache", "edge", "origin")
_LINKS = (
    ("the SSE spec", "https://html.spec.whatwg.org/multipage/server-sent-events.html"),
    ("MDN on EventSource", "https://developer.mozilla.org/en-US/docs/Web/API/EventSource"),
    ("RFC 9110", "https://www.rfc-editor.org/rfc/rfc9110"),
    ("the maintainers", "mailto:maintainers@example.com"),
)
_EXTRAS = ("流式传输", "ストリーミング", "스트리밍", "🚀", "✨", "naïve café")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _sentence(rng: random.Random, inline: bool = True) -> str:
    words = _words(rng, rng.randint(6, 14)).split()
    words[0] = words[0].capitalize()
    if inline:
        roll = rng.random()
        at = rng.randrange(1, len(words))
        if roll < 0.25:
            words.insert(at, f"**{_words(rng, rng.randint(1, 3))}**")
        elif roll < 0.5:
            words.insert(at, f"`{rng.choice(_TERMS)}`")
        elif roll < 0.62:
            words.insert(at, f"*{rng.choice(_WORDS)}*")
        elif roll < 0.7:
            words.insert(at, rng.choice(_EXTRAS))
    return " ".join(words) + rng.choice(".....!?")


def _paragraph(rng: random.Random, sentences: int | None = None) -> str:
    n = sentences or rng.randint(2, 4)
    return " ".join(_sentence(rng) for _ in range(n)) + "\n\n"


def _filler(rng: random.Random, n: int) -> list[str]:
    """Sentences of exactly `n` tokens in all (every block before them ends in a blank
    line), in paragraphs of a few sentences."""
    tokens: list[str] = []
    words_left = sentences_left = 0
    while len(tokens) < n - 1:
        word = rng.choice(_WORDS)
        if words_left == 0:  # a new sentence
            if sentences_left == 0:
                if tokens:
                    tokens.append("\n\n")
                    if len(tokens) == n - 1:
                        break
                sentences_left = rng.randint(2, 4)
                tokens.append(word.capitalize())
            else:
                tokens.append(" " + word.capitalize())
            words_left = rng.randint(6, 12)
            sentences_left -= 1
        else:
            tokens.append(" " + word)
        words_left -= 1
        if words_left == 0 and len(tokens) < n - 1:
            tokens.append(".")
    if not tokens or tokens[-1] == "\n\n":
        tokens.append("Done.")
    else:
        tokens.append(" end." if tokens[-1] == "." else ".")
    return tokens[:n] if n > 0 else []


# ---- markdown ---------------------------------------------------------------------------------

_CODE: tuple[tuple[str, str], ...] = (
    (
        "python",
        "import httpx\n\n"
        "def read(url: str) -> list[str]:\n"
        '    """Collect the tokens of one stream."""\n'
        "    tokens = []\n"
        '    with httpx.stream("GET", url) as response:\n'
        "        for line in response.iter_lines():\n"
        '            if line.startswith("data: ") and line != "data: [DONE]":\n'
        "                tokens.append(line[6:])\n"
        "    return tokens\n",
    ),
    (
        "javascript",
        "const source = new EventSource(eventsUrl);\n"
        'source.addEventListener("message", (e) => {\n'
        '  if (e.data === "[DONE]") return source.close();\n'
        "  answer.append(JSON.parse(e.data).token);\n"
        "});\n",
    ),
    (
        "bash",
        "curl -sN http://127.0.0.1:8000/v1/streams \\\n"
        "  -H 'Content-Type: application/json' \\\n"
        '  -d \'{"prompt": "hello", "max_tokens": 50}\'\n',
    ),
    (
        "json",
        '{\n  "id": "str_42",\n  "resume_token": "rt_9f2c",\n'
        '  "events_url": "/v1/streams/str_42/events?token=rt_9f2c"\n}\n',
    ),
    (
        "",
        'data: {"token": "Hello"}\nid: 1\n\ndata: {"token": " world"}\nid: 2\n\ndata: [DONE]\n',
    ),
)


def _heading(rng: random.Random, level: int) -> str:
    return f"{'#' * level} {rng.choice(_TOPICS)}\n\n"


def _bullets(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(3, 5)):
        item = _sentence(rng, inline=False)
        roll = rng.random()
        if roll < 0.35:
            item = f"**{rng.choice(_NAMES)}**: {item}"
        elif roll < 0.6:
            item = f"`{rng.choice(_TERMS)}` {item[0].lower()}{item[1:]}"
        elif roll < 0.7:
            text, url = rng.choice(_LINKS)
            item = f"{item} See [{text}]({url})."
        lines.append(f"- {item}\n")
    return "".join(lines) + "\n"


def _numbered(rng: random.Random) -> str:
    lines = [f"{i}. {_sentence(rng)}\n" for i in range(1, rng.randint(3, 5) + 1)]
    return "".join(lines) + "\n"


def _code(rng: random.Random) -> str:
    language, body = rng.choice(_CODE)
    return f"```{language}\n{body}```\n\n"


def _table(rng: random.Random) -> str:
    headers = ["Setting", "Value", "Effect"][: rng.randint(2, 3)]
    if len(headers) == 3 and rng.random() < 0.5:
        headers.append("Notes")
    rows = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join(rng.choice(("---", ":---", "---:", ":---:")) for _ in headers) + "|",
    ]
    for _ in range(rng.randint(2, 5)):
        cells = [f"`{rng.choice(_TERMS)}`", str(rng.randint(1, 5000))]
        cells += [_words(rng, rng.randint(1, 4)) for _ in headers[2:]]
        if len(cells) > 2 and rng.random() < 0.3:
            cells[2] = f"**{cells[2]}**"
        if len(cells) > 3 and rng.random() < 0.3:
            cells[3] = rng.choice(_EXTRAS)
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n\n"


def _link_paragraph(rng: random.Random) -> str:
    text, url = rng.choice(_LINKS)
    return f"{_sentence(rng)} More in [{text}]({url}), {_words(rng, 3)}.\n\n"


def _quote(rng: random.Random) -> str:
    return f"> {_sentence(rng)}\n> {_sentence(rng, inline=False)}\n\n"


def _markdown_blocks(rng: random.Random) -> Iterator[str]:
    """Endless sections: each has every construct, in an order and sizes drawn from `rng`."""
    first = True
    while True:
        yield _heading(rng, 1 if first else 2)
        yield _paragraph(rng, 2 if first else None)
        first = False
        middle: list[Callable[[random.Random], str]] = [
            _bullets,
            _numbered,
            _code,
            _table,
            _link_paragraph,
        ]
        rng.shuffle(middle)
        for make in middle:
            if rng.random() < 0.3:
                yield _heading(rng, 3)
            yield make(rng)
            if rng.random() < 0.4:
                yield _paragraph(rng, 1)
        if rng.random() < 0.3:
            yield _quote(rng)


# ---- hostile ----------------------------------------------------------------------------------

# What a page must show as text, never run, load or link: raw HTML and script, handlers in
# attributes, and Markdown links to schemes other than http(s)/mailto.
_PAYLOADS = (
    "<img src=x onerror=alert(1)>",
    "<script>alert(document.cookie)</script>",
    "[click](javascript:alert(1))",
    '<iframe src="https://example.com/frame"></iframe>',
    '<a href="javascript:alert(2)">a link</a>',
    '"><svg onload=alert(3)>',
    "[again](JavaScript:alert(4))",
    "![pixel](https://example.com/p.png)",
    '[title](https://example.com/" onmouseover="alert(5))',
    "[data](data:text/html,<script>alert(6)</script>)",
    "<style>body { display: none }</style>",
    "&lt;b&gt; entities &amp; stay as typed",
    "**<b>bold html</b>** and `<script>in code</script>`",
)


def _hostile_blocks(rng: random.Random) -> Iterator[str]:
    """First every payload once, in order (so even a short answer has a `<script>`), then
    payloads drawn at random between prose, in paragraphs, list items and code fences."""
    yield f"Here it is: {_PAYLOADS[1]}\n\n"
    yield f"And {_PAYLOADS[0]}\n\n"
    for payload in _PAYLOADS[2:]:
        yield f"{_sentence(rng, inline=False)} {payload}\n\n"
    while True:
        roll = rng.random()
        payload = rng.choice(_PAYLOADS)
        if roll < 0.5:
            yield f"{_sentence(rng, inline=False)} {payload} {_sentence(rng)}\n\n"
        elif roll < 0.75:
            yield "".join(f"- {rng.choice(_PAYLOADS)}\n" for _ in range(3)) + "\n"
        else:
            yield f"```html\n{payload}\n{rng.choice(_PAYLOADS)}\n```\n\n"
