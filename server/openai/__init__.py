"""The contract between the router and the servers (docs/structure.md): request and response
schema, formatting, SSE, errors, JSON and the OpenAPI document. It imports neither the engine nor
torch: the router depends on it alone.
"""
