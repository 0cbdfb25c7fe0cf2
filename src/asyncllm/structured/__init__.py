"""Structured outputs through xgrammar: grammars from StructuredOutputsParams (checked
when a request is submitted), compiled in the engine core off its step loop, and one
matcher per request that masks the tokens which cannot continue a valid output."""
