"""Online control of a heterogeneous job (pure logic).

:mod:`.shares` splits a global batch across groups whose batch time is
affine in their share (Ling et al.'s linear solve); :mod:`.cost` trades
batch time against a long-term cost budget with Lyapunov drift-plus-penalty.
"""
