"""Structured output: constrain sampling to a JSON schema, regex, grammar or choice list.

    backend  = GrammarBackend(hf_tokenizer)                 # once per tokenizer
    compiled = backend.compile(params.structured)           # at submission; ValueError on bad/unsupported specs
    matcher  = backend.matcher(compiled)                    # per request
    bitmask  = allocate_token_bitmask(rows, backend.vocab_size)
    fill_bitmasks([(matcher, row, drafts), ...], bitmask)   # CPU, in a thread during the forward pass
    apply_token_bitmask(logits, bitmask, rows)              # on the logits' device, whole batch at once
    matcher.accept(token) / matcher.rollback(n) / matcher.forced_tokens()

See README.md in this folder for the backend choice and how each JSON-schema keyword is enforced.
"""

from leapdecode.structured.aligned import AsapTrie, asap_reweight
from leapdecode.structured.backend import CompiledGrammar, GrammarBackend, fill_bitmasks
from leapdecode.structured.bitmask import allocate_token_bitmask, apply_token_bitmask, bitmask_to_bool
from leapdecode.structured.matcher import Matcher
from leapdecode.structured.spec import StructuredSpec, parse_structured

__all__ = [
    "AsapTrie",
    "CompiledGrammar",
    "GrammarBackend",
    "Matcher",
    "StructuredSpec",
    "allocate_token_bitmask",
    "apply_token_bitmask",
    "asap_reweight",
    "bitmask_to_bool",
    "fill_bitmasks",
    "parse_structured",
]
