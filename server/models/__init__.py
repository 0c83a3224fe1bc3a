"""Models: built-in tiny models, model specs, our Llama-family model, paged attention, the runner."""
