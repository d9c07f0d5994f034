"""An independent, slow, per-token reference of SPEC.md (sections 2-6 and 9) and random event streams.

Used to cross-check ``staleness-metrics replay`` line by line. Written from SPEC.md alone.
"""
