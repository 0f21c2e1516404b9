"""Constrained decoding: what a request may make the model write, as token masks.

Owns: checking and compiling a request's ``response_format`` into a per-sequence matcher
(``grammar.py``), admitting a client's JSON schema before it takes a lane
(``schema_check.py``) and the server's ``tool_choice`` and reasoning budgets as grammars
of the chat markup (``tool_grammar.py``). Does not own: applying the mask
(``libk3.engine.sampler``) or the stop rule (``libk3.engine.stops``). Sits beside text:
it reads token bytes and the chat markup, never the model.
"""
