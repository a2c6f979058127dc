"""The API: one request pipeline (`pipeline.py`) and a folder per format beside it (openai/,
anthropic/, responses/, native/), the route table (`routes.py`), and the gateway's steps
(`gateway.py`)."""
