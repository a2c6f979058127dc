"""The API: one request pipeline (`pipeline.py`) and a folder per format beside it (openai/,
anthropic/, responses/, native/), the route table (`routes.py`), the gateway's steps
(`gateway.py`), and what moves a stream between instances (`takeover.py`)."""
