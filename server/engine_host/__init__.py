"""The engine's host: a thread of the server process or a process of its own (docs/structure.md).
The engine (server/engine/) imports nothing of it."""
