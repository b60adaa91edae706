"""``GET /v1/models`` and ``GET /v1/models/{id}``: the model this gateway serves, in OpenAI's shape.

The official ``openai`` client's ``client.models.list()``, and the many tools that call it when
they start, expect this route. The gateway serves exactly one model name: clients send
``settings.vllm.served_model_name``, and the gateway relays the ``model`` field to the fleet,
which serves the policy under that name. With ``trainer.adapter = lora`` that name is the
adapter's (the gateway sets it when a request leaves it out and refuses any other,
`ingest.shaping.lora_request`); the base model, served as ``<name>-base``, is not served through
the gateway and is not listed.

The list is answered from the settings, without a call to vLLM, so it works while every server
is out of rotation; ``created`` is when this gateway started. Authentication and rate limits are
those of every API route (any valid key; `ingest.gateway.Gateway.authenticate`); calls are
counted in ``rtrl_gateway_requests_total{endpoint="models"}``.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ingest.gateway import Gateway
from ingest.responses import error

OWNED_BY = "rtrl"


def model_card(gw: Gateway) -> dict[str, Any]:
    """The served model as an OpenAI model object."""
    return {
        "id": gw.settings.vllm.served_model_name,
        "object": "model",
        "created": gw.started_at,
        "owned_by": OWNED_BY,
    }


async def list_models(gw: Gateway, request: Request) -> Response:
    """``GET /v1/models``: the served model in an OpenAI list."""
    caller = gw.authenticate(request, None)
    response = (
        caller if isinstance(caller, Response) else JSONResponse({"object": "list", "data": [model_card(gw)]})
    )
    gw.metrics.requests.labels("models", str(response.status_code)).inc()
    return response


async def get_model(gw: Gateway, request: Request) -> Response:
    """``GET /v1/models/{model_id}``: the served model, or 404 for any other name."""
    caller = gw.authenticate(request, None)
    if isinstance(caller, Response):
        response = caller
    else:
        model_id = request.path_params["model_id"]
        card = model_card(gw)
        if model_id == card["id"]:
            response = JSONResponse(card)
        else:
            response = error(
                404, f"model {model_id!r} is not served here; this gateway serves {card['id']!r}"
            )
    gw.metrics.requests.labels("models", str(response.status_code)).inc()
    return response
