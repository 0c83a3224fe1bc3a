"""Processes: `serve` builds one server (engine + HTTP), `launcher` starts a deployment from its
YAML, `supervisor` restarts what dies, `drain` stops a server without losing what it runs."""
