"""The contract between the control plane and the data planes, in Python.

The mirror of ``dataplane/common/lb_tables.h`` (:mod:`.tables`), ring patches
(:mod:`.ringdiff`), the flow hash both data planes compute (:mod:`.flowhash`)
and the reference model of the per-packet decision (:mod:`.model`). The
lowest floor: it imports nothing else of hpclb.
"""
