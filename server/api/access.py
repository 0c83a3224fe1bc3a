"""Who may drive the KV plane through a server's OpenAI endpoints (docs/SECURITY.md): a request with
`disaggregated_params` needs the deployment token, and a generation_only one may only name the KV
endpoint of one of this deployment's context servers (`ContextDirectory`). Both checks run before
anything reaches the engine: a refused request pins nothing and connects nowhere.
"""

from __future__ import annotations

from starlette.requests import Request

from server.auth import TOKEN_HEADER, missing_token_message, token_matches
from server.openai.errors import APIError
from server.openai.protocol import DisaggParams

PARAM = "disaggregated_params"


def require_token(request: Request, what: str) -> None:
    """401 unless the request carries this server's deployment token."""
    token = getattr(request.app.state, "auth_token", None)
    if not token_matches(request.headers.get(TOKEN_HEADER), token):
        raise APIError(401, missing_token_message(token, what), code="unauthorized")


async def check_disagg_access(request: Request, params: DisaggParams | None) -> None:
    if params is None:
        return
    require_token(request, PARAM)
    if params.request_type != "generation_only" or params.ctx_endpoint is None:
        return  # a generation_only request without an endpoint is refused by the engine (400)
    directory = getattr(request.app.state, "context_directory", None)
    if directory is None or not await directory.knows(params.ctx_endpoint):
        raise APIError(403, f"{PARAM}.ctx_endpoint {params.ctx_endpoint!r} is not the KV endpoint of a "
                       "context server of this deployment; this server pulls from no other address",
                       param=f"{PARAM}.ctx_endpoint", code="unknown_context_server")
