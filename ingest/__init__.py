"""The capture gateway: an OpenAI-compatible front door to the vLLM fleet that records every call.

``rtrl gateway`` starts it (`ingest.app.run`). Modules:

- `ingest.app`: the Starlette application (its routes, middleware and lifespan) and `run(settings)`.
- `ingest.gateway`: `Gateway`, what the routes of one instance share, and `authenticate`.
- the routes, one module per role: `ingest.completions` (``/v1/completions``,
  ``/v1/chat/completions``, and ``/v1/responses`` translated into chat by `ingest.responses_api`
  and `ingest.responses_stream`; streams through `ingest.relay`, captured by `ingest.capture`),
  `ingest.feedback_route` (``/v1/feedback``), `ingest.served_models` (``/v1/models``),
  `ingest.operations` (``/healthz``, ``/readyz``, ``/metrics``, ``/v1/whoami``); errors in the
  OpenAI shape from `ingest.responses`.
- `ingest.shaping`: pure functions that add the capture fields to a client's request, strip them
  from the response again and turn the upstream response into an `InteractionEvent`.
- `ingest.routing`: which vLLM server serves a request (round robin, health, weight versions).
- `ingest.publisher`: background Kafka producer that falls back to `ingest.spool`, the bounded
  on-disk spool that is replayed when the broker is back.
- `ingest.metrics`: the Prometheus metrics of one gateway instance.
"""
