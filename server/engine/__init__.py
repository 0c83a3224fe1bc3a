"""The engine: request state, scheduler, sampler, the step loop and its asyncio bridge."""
