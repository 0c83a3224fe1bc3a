"""The speculation policy a server's `speculative:` section asks for."""

from __future__ import annotations

from server.engine.scheduler import SchedulerConfig
from server.engine.speculative.config import SpeculativeConfig
from server.engine.speculative.decoder import NoSpeculation, SpecDecoder
from server.engine.speculative.draft_model import build_draft_drafter
from server.engine.speculative.ngram import NgramDrafter


def build_spec(config: SpeculativeConfig, limits: SchedulerConfig, runner=None) -> SpecDecoder | NoSpeculation:
    """`runner`: the target's model runner (a draft model runs on its device, in its dtype)."""
    if config.method == "ngram":
        return SpecDecoder(config, limits, NgramDrafter(config.ngram_min, config.ngram_max))
    if config.method == "draft_model":
        drafter = build_draft_drafter(config.draft_model, runner, limits.max_seq_len, 2 * config.max_decode_batch)
        return SpecDecoder(config, limits, drafter)
    return NoSpeculation()
