"""The contract between the router and the servers: the OpenAI request and response schema with
TensorRT-LLM's `disaggregated_params` (`protocol`), the formatting of outputs into bodies and
stream chunks (`formatting`, which the router uses too for the first token it streams itself),
SSE framing and the one SSE response with disconnect watching (`sse`), the error body
(`errors`), JSON in and out (`wire`, pydantic-core's codec on every hop) and the OpenAPI document
(`openapi`). It imports neither the engine nor torch: the router depends on it alone.
"""
