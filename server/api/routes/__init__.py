"""One router per concern: completions, chat, models, health, metrics."""
