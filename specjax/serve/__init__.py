"""`specjax serve`: an OpenAI-compatible HTTP server on the engine (FastAPI routes in app.py, request checks in
protocol.py, response formats in responses.py, Prometheus /metrics in metrics.py, the command in main.py)."""
