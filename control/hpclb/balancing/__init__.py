"""How traffic is shared: Maglev rings from weights (:mod:`.maglev`) and the
weight formula that turns a node's load into a weight (:mod:`.weights`).
"""
