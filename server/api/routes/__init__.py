"""One router per concern: the OpenAI API (v1), health and metrics; internal KV endpoints (kv_cache)."""
