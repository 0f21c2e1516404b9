"""The generation request every surface turns its input into: a batch line, an OpenAI chat
or completion body, an Anthropic Messages body.

Owns: the request's types and their validators (``model``: one rule per field, the rules
of ``libk3.engine.settings``), the field names each surface reads and the one wording of
a refused field (``fields``), a checked request's settings over a run's
(``settings``), and the image parts of its messages (``images``). Does not own: a surface's own shapes (batch lines: ``libk3.run.batch``;
HTTP bodies: ``libk3.serve.protocol``, ``libk3.serve.anthropic``) or generation.
"""
