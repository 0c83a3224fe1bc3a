"""The OpenAI-facing router: context-first orchestration of a disaggregated deployment."""
