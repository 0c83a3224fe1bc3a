"""The engine's host: the loop that runs an `EngineCore` (loop.py), the messages it trades with the
HTTP side (wire.py), the front the HTTP side reads (front.py), and its two hosts: a thread of the
server process (thread.py) or a process of its own (process.py, main.py). build.py makes the core on
the host's thread. The engine (server/engine/) imports nothing of it."""
