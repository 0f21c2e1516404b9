"""Speculative decoding: proposing tokens and verifying them exactly in one pass.

Owns: one sequence's drafting step, the verify width and the run's drafting counters
(``speculative.py``), and where proposals come from: the prompt's own ids or the DSpark
draft (``proposers.py``). Does not own: the passes that run the verify blocks
(``libk3.engine.core``), sampling (``libk3.engine.sampler``)
or the draft model (``libk3.draft``). Sits in the engine's layer: it prices widths with
the engine's pace model.
"""
