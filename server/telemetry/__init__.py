"""What a server tells the outside: Prometheus `metrics`, the engine-thread `bridge` that feeds
them, and the `kv_events` channel that keeps the router's cache index."""
