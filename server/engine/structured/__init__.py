"""Structured output: a request's output constrained by a grammar (JSON object, JSON schema, regex,
choice, EBNF/Lark) compiled with llguidance. The grammar is fed the output a request already has when
it is added and each token it appends; a step's bitmask is filled on the CPU after the forward is
queued and masks the logits the sampler samples from; a complete grammar ends the request ("stop").
Constrained requests do not draft (speculative decoding).
"""
