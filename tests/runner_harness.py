"""Steps of a model runner that several runner, kernel and CUDA tests take alike: the decode rows
after a prefill, and a region where the host must not synchronise with the device.

Imported as `import runner_harness` (tests/ is on sys.path, as for engine_harness).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from server.models.runner import ModelRunner, SeqChunk


def prefilled_decode_rows(runner: ModelRunner, prompts: list[list[int]], first_token: int,
                          prefill: ModelRunner | None = None) -> list[SeqChunk]:
    """Each prompt admitted as request `r{i}` and prefilled (one step each, by `prefill`, a runner of
    the same model over the same cache, else by `runner`); the decode row that follows each, its
    token `first_token + i`, for one step of them all."""
    kv, rows = runner.kv, []
    for i, p in enumerate(prompts):
        kv.admit(f"r{i}", p, num_tokens=len(p) + 1)
        tables = {w: kv.slot_table(f"r{i}", w) for w in kv.window_sizes}
        (prefill or runner).execute([SeqChunk(p, 0, tables, True)])
        rows.append(SeqChunk([first_token + i], len(p), tables, True))
    return rows


@contextlib.contextmanager
def no_host_syncs() -> Iterator[None]:
    """Inside, torch's CUDA sync debug mode is "error": any stream or device synchronisation (a
    blocking copy, .item(), .tolist() of a device tensor) raises. The device is idle on entry."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
