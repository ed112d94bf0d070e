"""`onnxgen serve`: an OpenAI-compatible HTTP server over the genai layer (docs/server.md).

Modules: options.py (``ServeOptions``), protocol.py (request parsing and validation), jobs.py
(requests to scheduler jobs), relay.py (outputs to JSON or SSE), responses.py (OpenAI's shapes),
metrics.py (Prometheus text), app.py (routes), serve.py (uvicorn, signals, drain). The server
imports the genai layer only (the Generator's text side and ``genai.scheduler``), never the runtime.
"""

from onnxgen.server.options import ServeOptions

__all__ = ["ServeOptions"]
