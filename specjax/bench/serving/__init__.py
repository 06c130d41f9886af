"""`specjax bench serve`: a load generator for any OpenAI-compatible server, with vLLM's flags and metrics.

datasets.py makes the requests (random ids, a ShareGPT / JSONL file, the embedded held-out prompts); arrivals.py
says when each is sent (Poisson, Gamma, a ramp, or as fast as --max-concurrency allows); client.py sends one
streamed request and times its chunks; metrics.py turns the timings into vLLM's numbers; server_metrics.py reads the
server's Prometheus /metrics before, during and after; main.py is the command; plot.py draws. Nothing here imports
the rest of specjax's machinery: it measures a server over HTTP, whichever engine runs it.
"""
