"""What a server tells the outside: Prometheus `metrics`, the engine's figures and observations
relayed to them (`relay`), and the `kv_events` channel that keeps the router's cache index."""
