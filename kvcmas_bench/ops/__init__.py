"""Pure tensor math: RoPE re-alignment, low-rank factors and distances, selection rules.

Nothing here touches a model, a method's state or a file; every function is unit-tested against a
closed form or a direct computation.
"""
