"""The capture gateway: an OpenAI-compatible front door to the vLLM fleet that records every call.

``rtrl gateway`` starts it (`ingest.app.run`). Modules:

- `ingest.app`: the Starlette application (``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/feedback``, ``/healthz``, ``/readyz``, ``/metrics``) and `run(settings)`.
- `ingest.shaping`: pure functions that add the capture fields to a client's request, strip them
  from the response again and turn the upstream response into an `InteractionEvent`.
- `ingest.routing`: which vLLM server serves a request (round robin, health, weight versions).
- `ingest.publisher`: background Kafka producer that falls back to `ingest.spool`, the bounded
  on-disk spool that is replayed when the broker is back.
- `ingest.metrics`: the Prometheus metrics of one gateway instance.
"""
