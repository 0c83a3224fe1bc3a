"""What the router decides for each request (docs/ROUTING.md): the server of each leg (`LegPicker`),
the KV index kv_cache_aware reads (`KvEventSync`), and conditional disaggregation."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter

from server.config.router import Conditional, RouterConfig
from server.router.backends import Backend
from server.router.http_client import HttpClient
from server.router.kv_sync import KvEventSync
from server.router.policies import PromptTokens, hit_tokens, make_policy, prompt_length
from server.router.queue import LegPicker, QueueMetrics


class Routing:
    def __init__(self, config: RouterConfig, context: Sequence[Backend], generation: Sequence[Backend],
                 registry: CollectorRegistry, client: HttpClient | None = None) -> None:
        self.policy = config.type
        self.context, self.generation = list(context), list(generation)
        metrics = QueueMetrics(registry)
        # generation servers: kv_cache_aware scores them too (their own hit saves a pull)
        self.context_picker = LegPicker("context", make_policy(config), config.queue, metrics)
        self.generation_picker = LegPicker("generation", make_policy(config), config.queue, metrics, decodes=True)
        self.conditional: Conditional = (config.conditional if self.context else None) or Conditional()
        # the servers' KV events, followed when they are read (kv_cache_aware, or a minimum prefix hit)
        follow = self.policy == "kv_cache_aware" or self.conditional.min_prefix_hit is not None
        self.sync = (KvEventSync(self.context + self.generation, client, config.auth_token, registry)
                     if follow and config.auth_token and client is not None else None)
        self._local = Counter("pdserve_router_local_requests", "Requests a generation server served alone, by "
                              "reason (short_prefill, prefix_hit: conditional disaggregation; several_prompts, "
                              "prompt_only)", ["reason"], registry=registry)
        self._split = Counter("pdserve_router_disaggregated_requests", "Requests that ran a context leg "
                              "(disaggregated deployments)", registry=registry)

    @property
    def needs_tokens(self) -> bool:
        """The router tokenises prompts (kv policies, conditional disaggregation)."""
        return self.policy == "kv_cache_aware" or self.conditional.enabled

    def serve_locally(self, prompt: PromptTokens, several_prompts: bool = False, prompt_only: bool = False) -> bool:
        """Decide (and count) whether a request of a disaggregated deployment skips its context leg:
        conditional disaggregation, several prompts (each leg carries one), or nothing to generate."""
        reason = "several_prompts" if several_prompts else "prompt_only" if prompt_only else None
        if reason is None and self.conditional.enabled:
            reason = self._local_reason(prompt)
        if reason is None:
            self._split.inc()
            return False
        self._local.labels(reason).inc()
        return True

    def _local_reason(self, prompt: PromptTokens) -> str | None:
        length = prompt_length(prompt)
        if not length:
            return None  # not tokenised (no tokenizer, or a prompt the router cannot read)
        # the best hit among the servers that could take it; no policy call (round robin's turn would move)
        free = [b for b in self.generation if b.healthy and not self.generation_picker.saturated(b)]
        if not free:
            return None
        hit, c = max(hit_tokens(b, prompt) for b in free), self.conditional
        if c.min_prefix_hit is not None and hit >= c.min_prefix_hit:
            return "prefix_hit"
        if c.max_local_prefill_length is not None and length - hit <= c.max_local_prefill_length:
            return "short_prefill"
        return None
