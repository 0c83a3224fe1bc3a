"""One router per concern: the OpenAI API (v1), health, metrics."""
