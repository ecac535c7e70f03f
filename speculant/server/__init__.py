"""``speculant serve``: an OpenAI-compatible HTTP server (app.py) over one engine owner thread
(scheduler.py), with Prometheus metrics (metrics.py) and a playground page (playground.html)."""
