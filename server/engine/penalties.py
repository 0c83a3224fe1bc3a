"""Penalties and logit biases, applied on the device to the raw logits of a step's sampler rows, in
vLLM's order:
- `logit_bias`: (token, bias) pairs added to the row's logits;
- `repetition_penalty` r (transformers/vLLM): a token that occurs in the prompt OR the output has its
  logit divided by r when positive, multiplied by r otherwise;
- `frequency_penalty` f and `presence_penalty` p (OpenAI): over OUTPUT tokens only, with c the
  token's count, logit -= f * c + p * (c > 0).
A generation leg's first token(s) and a moved stream's prior output (`Request.counted_output`) are
output tokens.

The counts live on the device (`TokenCounts`): one row per penalised request, taken and initialised
from its known tokens at its first penalised sampler row, bumped on the device from each step's
sampled ids (no host round trip), given back when the request ends. A verify chunk's row i counts
the drafts before it too; its accepted run is added once on the host (verify steps are postprocessed
before the next schedule).
"""

from __future__ import annotations

import torch

from server.engine.request import Request
from server.engine.uploads import upload

MIN_ROWS = 8


def owner(row) -> Request:
    """The request of a sampler row (a `Request`, or a verify chunk's `VerifyRow`)."""
    return getattr(row, "request", row)


class TokenCounts:
    """Per penalised request: its output token counts [rows, vocab] int32 and its prompt's tokens
    [rows, vocab] bool, on `device`. Grown (doubled) when every row is taken."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None
        self._rows: dict[Request, int] = {}
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, request: Request, vocab: int) -> int:
        """The request's row, taken and initialised from its known tokens at its first call."""
        row = self._rows.get(request)
        if row is None:
            row = self._rows[request] = self._take(vocab)
            output, prompt = request.counted_output(), request.prompt_token_ids
            ids = upload(output + prompt, torch.int64, self.device)
            if output:
                self.counts[row].index_put_((ids[:len(output)],), self._ones(len(output)), accumulate=True)
            self.in_prompt[row].index_fill_(0, ids[len(output):], True)
        return row

    def add(self, request: Request, tokens: list[int]) -> None:
        """Count host-known output tokens (a verify chunk's accepted run) of a request with a row."""
        row = self._rows.get(request)
        if row is not None and tokens:
            self.counts[row].index_put_((upload(tokens, torch.int64, self.device),), self._ones(len(tokens)),
                                        accumulate=True)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count one sampled token per given row, on the device: tokens[i] in row rows[i]."""
        self.counts.index_put_((rows, tokens), self._ones(len(tokens)), accumulate=True)

    def release(self, request: Request) -> None:
        row = self._rows.pop(request, None)
        if row is not None:
            self._free.append(row)

    def _take(self, vocab: int) -> int:
        if not self._free:
            self._grow(vocab)
        row = self._free.pop()
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        return row

    def _grow(self, vocab: int) -> None:
        old = 0 if self.counts is None else self.counts.shape[0]
        size = max(MIN_ROWS, 2 * old)
        counts = torch.zeros(size, vocab, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(size, vocab, dtype=torch.bool, device=self.device)
        if old:
            counts[:old].copy_(self.counts)
            in_prompt[:old].copy_(self.in_prompt)
        self.counts, self.in_prompt = counts, in_prompt
        self._free.extend(range(size - 1, old - 1, -1))  # the lowest row is taken first

    def _ones(self, n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.int32, device=self.device)


def apply_logit_bias(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """`logits` with each row's logit_bias added (a new tensor when any; ids outside the vocabulary
    are ignored: the API refuses them)."""
    at, cols, biases = [], [], []
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        for token, bias in row.sampling.logit_bias:
            if 0 <= token < vocab:
                at.append(i)
                cols.append(token)
                biases.append(bias)
    if not at:
        return logits
    index = upload(at + cols, torch.int64, logits.device)
    values = upload(biases, torch.float32, logits.device)
    return logits.index_put((index[:len(at)], index[len(at):]), values, accumulate=True)


class StepPenalties:
    """The penalised rows of one step's sampler rows: applied before sampling, counted after."""

    def __init__(self, rows: list, counts: TokenCounts, vocab: int) -> None:
        chosen = [i for i, row in enumerate(rows) if row.sampling.penalized]
        self.counts, self.size = counts, len(chosen)
        count_rows = [counts.row(owner(rows[i]), vocab) for i in chosen]
        drafted = [(j, t) for j, i in enumerate(chosen) for t in getattr(rows[i], "drafted", ())]
        plain = [j for j, i in enumerate(chosen) if owner(rows[i]) is rows[i]]  # verify rows: counted at accept
        self._num_plain = len(plain)
        params = [rows[i].sampling for i in chosen]
        device = counts.device
        self._ints = upload(chosen + count_rows + [j for j, _ in drafted] + [t for _, t in drafted] + plain,
                            torch.int64, device)
        self._floats = upload([p.repetition_penalty for p in params] + [p.frequency_penalty for p in params]
                              + [p.presence_penalty for p in params], torch.float32, device)
        self._num_drafted = len(drafted)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        n, d = self.size, self._num_drafted
        index, count_rows = self._ints[:n], self._ints[n:2 * n]
        rep, freq, pres = (self._floats[i * n:(i + 1) * n] for i in range(3))
        if logits.is_cuda and not d:  # one fused pass (a verify row's drafts take the torch path)
            from server.models.kernels.penalties import penalise  # (Triton: installed with CUDA only)

            return penalise(logits, index, count_rows, self.counts.counts, self.counts.in_prompt, rep, freq, pres)
        occurs = self.counts.counts.index_select(0, count_rows).float()
        if d:  # a verify row's drafts before it are output tokens of its position
            at = 2 * n
            occurs.index_put_((self._ints[at:at + d], self._ints[at + d:at + 2 * d]),
                              torch.ones(d, device=occurs.device), accumulate=True)
        in_output = occurs > 0
        seen = in_output | self.counts.in_prompt.index_select(0, count_rows)
        rep, freq, pres = rep[:, None], freq[:, None], pres[:, None]
        sub = logits.index_select(0, index)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - freq * occurs - pres * in_output.float()
        return logits.index_copy(0, index, sub)

    def record(self, picked: torch.Tensor) -> None:
        """Count the sampled ids of the plain rows (a verify chunk's are counted when accepted)."""
        n, d = self.size, self._num_drafted
        index, count_rows = self._ints[:n], self._ints[n:2 * n]
        if not self._num_plain:
            return
        if self._num_plain < n:
            plain = self._ints[2 * n + 2 * d:]
            index, count_rows = index.index_select(0, plain), count_rows.index_select(0, plain)
        self.counts.record(count_rows, picked.index_select(0, index))
