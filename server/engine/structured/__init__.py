"""Structured output: a request's output constrained by a grammar (JSON object, JSON schema, regex,
choice, EBNF/Lark), compiled with llguidance.

The engine's hooks (`StructuredOutput`, server/engine/core.py): a request's grammar is attached when
it is added (fed the output it already has: a generation leg's first token, a moved stream's prior
output); each output token is fed to it as the request appends it (`Request.append_token`); a step's
bitmask is filled on the CPU after the forward is queued and applied to the logits the sampler
samples from (`sample_on_device(..., mask=)`); a request whose grammar is complete ends with "stop".
With async scheduling, a step holding constrained requests is postprocessed before the next schedule
(their next mask needs their token). Constrained requests do not draft (speculative decoding).
"""
